"""`GET /metrics` read as Prometheus reads it."""

from __future__ import annotations

import aiohttp
from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    """One parsed `/metrics` answer: samples by (name, labels)."""

    def __init__(self, text: str) -> None:
        """Parse the text as Prometheus does (text format 0.0.4)."""
        self.text = text
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        for family in self.families.values():
            for sample in family.samples:
                self.samples[(sample.name, frozenset(sample.labels.items()))] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """The value of one sample; KeyError when absent."""
        return self.samples[(name, frozenset(labels.items()))]

    def label_values(self, name: str, label: str) -> set[str]:
        """Every value `label` takes among a sample name's series."""
        return {dict(key)[label] for (sample, key) in self.samples if sample == name and label in dict(key)}

    def names(self) -> set[str]:
        """Every sample name in the scrape."""
        return {sample for (sample, _labels) in self.samples}

    def type_lines(self) -> list[str]:
        """The family name of every `# TYPE` line, in order (a repeat makes Prometheus reject the scrape)."""
        return [line.split()[2] for line in self.text.splitlines() if line.startswith("# TYPE ")]


async def scrape(http: aiohttp.ClientSession, url: str) -> Scrape:
    """GET /metrics and parse it."""
    async with http.get(url + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        return Scrape(await resp.text())
