"""bench_overload's client and floor server, small: every connection of a burst gets its
status line timed, and the floor server answers each with its canned 429."""

from tqserve.tools import bench_overload


def test_burst_against_the_floor_server_times_every_connection():
    floor = bench_overload.measure_floor(64)
    assert floor["statuses"] == {"429": 64}
    assert 0 < floor["p50"] <= floor["p99"]


def test_burst_counts_a_server_that_never_answers_as_pending():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts (the kernel does), never answers
    try:
        seconds = bench_overload.burst(listener.getsockname()[1], 5,
                                       bench_overload._post(bench_overload.SHORT))
    finally:
        listener.close()
    assert list(seconds) == ["pending"] and len(seconds["pending"]) == 5
