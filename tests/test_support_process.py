"""The test harness's own check that a ready answer came from the child it started.

Under xdist a port free_port() found may be taken by another test's server before the child
binds it; that server then answers the child's readiness probe. `holds_listener` tells the two
apart by the listening socket's inode among the child's descriptors.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.support.process import holds_listener


def test_the_listener_is_found_in_the_process_holding_it_and_not_in_another() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert holds_listener(os.getpid(), port) is True
            assert holds_listener(child.pid, port) is False  # it answers nothing on that port
        finally:
            child.kill()
            child.wait()
    assert holds_listener(os.getpid(), port) is False  # closed: nobody listens there
