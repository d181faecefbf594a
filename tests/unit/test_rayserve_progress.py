"""api.rayserve.progress: the front's first-token notes reach a router on another thread's
event loop (as Ray runs its routers), and wake a decision that waits for one. Plain
asyncio and threads, no Ray."""

from __future__ import annotations

import asyncio
import threading

from tqserve.api.rayserve.progress import note_first_token, take_first_tokens, wait_for_note

BOUND = 30.0  # seconds a wake-up may take before the test fails (never a measurement)


def test_a_note_from_another_thread_wakes_a_waiting_decision():
    take_first_tokens()  # whatever an earlier test left

    async def main() -> list[tuple[str, float]]:
        waiting = asyncio.ensure_future(wait_for_note(timeout=10 * BOUND))
        await asyncio.sleep(0)  # it is asleep now
        front = threading.Thread(target=note_first_token, args=("r1",))
        front.start()
        await asyncio.wait_for(waiting, BOUND)  # woken, long before its own timeout
        front.join()
        return take_first_tokens()

    notes = asyncio.run(main())
    assert [rid for rid, _ in notes] == ["r1"] and take_first_tokens() == []


def test_a_note_not_yet_read_ends_a_wait_at_once():
    take_first_tokens()
    note_first_token("r2")
    note_first_token("r3")

    async def main() -> None:
        await asyncio.wait_for(wait_for_note(timeout=10 * BOUND), BOUND)

    asyncio.run(main())
    notes = take_first_tokens()
    assert [rid for rid, _ in notes] == ["r2", "r3"] and notes[0][1] <= notes[1][1]
