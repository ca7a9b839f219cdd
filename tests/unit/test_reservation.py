"""router/reservation.py Reservation: the load one attempt charges on the router's view
of its workers, each part released exactly once: the prompt's tokens at the first
token, the streams when the attempt ends (the `with`), and D's own choice of who
prefills moving the prompt's charge; the placement's reasons as span attributes."""

from pdserve.messages import DecodeReservation
from pdserve.router.reservation import PlacementWhy, Reservation
from pdserve.router.workers import Worker


class Room:
    def __init__(self):
        self.freed_calls = 0

    def freed(self):
        self.freed_calls += 1


def _res(local: bool) -> DecodeReservation:
    return DecodeReservation(("127.0.0.1", 1), 1, 2, 0, local, 60)


def _workers():
    return Worker(None, "decode-0", 64), Worker(None, "prefill-0", 64)


def test_a_prefill_worker_s_charge_ends_at_the_first_token_and_the_streams_at_the_end():
    d, p = _workers()
    room = Room()
    with Reservation(d, p, 100, 2, room) as held:
        held.settle(_res(local=False))
        assert (p.queued_tokens, d.queued_tokens, d.streams) == (100, 0, 2)
        held.first_token()
        held.first_token()                                   # idempotent
        assert (p.queued_tokens, d.streams) == (0, 2) and held.first_token_seen
    assert (p.queued_tokens, d.queued_tokens, d.streams, room.freed_calls) == (0, 0, 0, 1)
    held.release()                                           # idempotent
    assert (d.streams, room.freed_calls) == (0, 1)


def test_the_decode_worker_s_own_choice_moves_the_prompt_to_its_queue():
    d, p = _workers()
    with Reservation(d, p, 100, 1) as held:
        held.settle(_res(local=True))                        # asked for P, D prefills
        assert held.p is None and held.prefiller is d
        assert (p.queued_tokens, d.queued_tokens) == (0, 100)
    assert (p.queued_tokens, d.queued_tokens, d.streams) == (0, 0, 0)


def test_a_refused_reservation_takes_its_charge_back_and_frees_nothing():
    d, p = _workers()
    room = Room()
    held = Reservation(d, None, 40, 3, room)
    assert (d.queued_tokens, d.streams) == (40, 3)
    held.refused()
    assert (d.queued_tokens, d.streams, p.queued_tokens, room.freed_calls) == (0, 0, 0, 0)


def test_placement_reasons_become_span_attributes_without_the_missing_ones():
    local = PlacementWhy("kv_aware", 3, 120, True)
    assert local.attributes() == {"pdserve.placement.routing_policy": "kv_aware",
                                  "pdserve.placement.decode_streams": 3,
                                  "pdserve.placement.decode_free_blocks": 120,
                                  "pdserve.placement.prefill_on_decode": True}
    remote = PlacementWhy("kv_aware", 3, 120, False, 64, 0)
    assert remote.attributes()["pdserve.placement.prefix_hit_tokens"] == 64
    assert remote.attributes()["pdserve.placement.prefill_queued_tokens"] == 0
