"""`cachewitness report`: `command.py` the subcommand and where the records come from; `data.py`
the session read from its records; `page.py` the HTML page; `svg.py` its plots."""
