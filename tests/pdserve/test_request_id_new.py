"""pdserve.request_id: ids made for requests without a usable X-Request-Id are ``req-`` + 32 hex
digits, distinct within a process and across forked processes."""

from __future__ import annotations

import os
import re

from pdserve import request_id


def test_made_ids_are_distinct_and_well_formed():
    ids = [request_id.from_headers([(b"x-request-id", b"bad id with spaces")]) for _ in range(1000)]
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == 1000


def test_a_forked_child_draws_its_own_random_half():
    parent = request_id.from_headers([])
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: write its id and leave at once
        os.write(write_fd, request_id.from_headers([]).encode())
        os._exit(0)
    os.close(write_fd)
    try:
        child = os.read(read_fd, 64).decode()
    finally:
        os.close(read_fd)
        os.waitpid(pid, 0)
    assert child.startswith("req-") and child[4:20] != parent[4:20]
