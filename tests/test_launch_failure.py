"""The launch stage's wire format and failure records, without ranks: the spawn spec survives its
JSON trip, and a RankFailure puts the root cause first and says what happened in words."""

from sp_harness.launch.failure import RankError, RankFailure, process_ended
from sp_harness.launch.wire import PoolOptions, WorkerSpec


def test_worker_spec_round_trips_through_json():
    spec = WorkerSpec(rank=1, world_size=2, store_port=1234, address=("127.0.0.1", 5678), stack_path="/s",
                      fatal_path="/f", options=PoolOptions(backend="nccl", devices=(0, 1), env=(("A", "b"),),
                                                           num_threads=2), sys_path=("/x", "/y"))
    assert WorkerSpec.from_json(spec.to_json()) == spec


def test_a_rank_that_died_comes_before_the_others_secondary_errors():
    secondary = RankError(rank=0, kind="raised", exc_type="RuntimeError", traceback="RuntimeError: connection reset")
    died = process_ended(1, -11, stack='  File "/u/case.py", line 3 in shard\n', log_tail="")
    failure = RankFailure("job", [secondary, died])
    assert failure.kind == "signal" and failure.first_rank == 1 and failure.ranks == [1, 0]
    assert died.signal_name == "SIGSEGV" and died.exit_code == -11
    assert failure.describe(with_traces=False) == "job: rank 1 killed by SIGSEGV; after it, rank 0 raised RuntimeError"
    assert failure.summary_line() == 'rank 1 at File "/u/case.py", line 3 in shard'


GLOO_ABORT = ("terminate called after throwing an instance of 'gloo::EnforceNotMet'\n"
              "  what():  [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
              "op.preamble.length <= op.nbytes. 512 vs 256. Received data size doesn't match expected size.")


def test_a_rank_gloo_aborted_is_named_with_gloos_own_message_in_the_one_line():
    # what a mismatched all-to-all leaves in the rank's output (a real run's log tail): its text,
    # not only the frame, reaches the one-line reason the text report and the battery show
    died = process_ended(1, -6, stack='  File "/t/distributed_c10d.py", line 5140 in all_to_all_single\n',
                         log_tail="some earlier line\n" + GLOO_ABORT)
    assert died.abort_message == ("gloo::EnforceNotMet: op.preamble.length <= op.nbytes. 512 vs 256. "
                                  "Received data size doesn't match expected size.")
    line = RankFailure("job", [died]).one_line()
    assert line.startswith("job: rank 1 killed by SIGABRT: rank 1: gloo::EnforceNotMet: op.preamble.length")
    assert line.endswith('(at File "/t/distributed_c10d.py", line 5140 in all_to_all_single)')
    # c10's fatal check, and an exit whose output holds one
    check = process_ended(0, 1, log_tail="[rank0]:[F1128 ProcessGroupGloo.cpp:1537] Check failed: a == b (24 vs. 12).")
    assert RankFailure("job", [check]).summary_line() == "rank 0: Check failed: a == b (24 vs. 12)."
    # nothing of the kind printed: the frame alone, as before
    assert process_ended(1, -6, log_tail="plain output").abort_message == ""


def test_a_nonzero_exit_is_exited_not_signal():
    err = process_ended(2, 3, log_tail="some output\nlast words")
    assert (err.kind, err.exit_code, err.signal_name) == ("exited", 3, "")
    assert RankFailure("job", [err]).summary_line() == "rank 2: last words"


def test_the_first_rank_to_raise_is_the_cause_with_its_own_message_first():
    # issue 21: rank 1's own error came first; rank 0's 'connection reset' is its consequence,
    # however the ranks are numbered, and a long message's first line is the one shown
    peer = RankError(rank=0, kind="raised", exc_type="RuntimeError", at=105.0, message="Connection reset by peer",
                     traceback="Traceback...\nRuntimeError: Connection reset by peer")
    cause = RankError(rank=1, kind="raised", exc_type="RuntimeError", at=100.0,
                      message="[enforce fail] Received data size doesn't match expected size",
                      traceback='  File "/u/case.py", line 9 in forward\nRuntimeError: [enforce fail] Received data '
                                "size doesn't match expected size\nException raised from recv at gloo/pair.cc")
    failure = RankFailure("job", [peer, cause])
    assert failure.first_rank == 1 and failure.ranks == [1, 0]
    head = failure.describe(with_traces=False)
    assert head.startswith("job: rank 1 raised RuntimeError: [enforce fail] Received data size doesn't match")
    assert head.endswith("after it, rank 0 raised RuntimeError")
    assert failure.summary_line() == ("rank 1: RuntimeError: [enforce fail] Received data size doesn't match "
                                      "expected size")
    full = failure.describe()
    assert full.index("--- rank 1") < full.index("--- rank 0")  # its traceback under the header naming it


def test_a_job_calling_sys_exit_is_an_exit_with_its_code():
    from sp_harness.launch.failure import raised
    from sp_harness.launch.wire import Job
    from sp_harness.launch.worker import run_job

    reply = run_job(Job(job_id=1, fn_ref="sys:exit", payload=3))
    err = raised(0, reply)
    assert (err.kind, err.exit_code) == ("exited", 3)
    assert RankFailure("job", [err]).describe(with_traces=False) == "job: rank 0 exited with code 3"


def test_a_hang_names_the_culprit_not_the_ranks_waiting_for_it():
    waiting = RankError(rank=0, kind="timeout",
                        traceback='  File "/v/torch/distributed/distributed_c10d.py", line 9 in barrier\n')
    culprit = RankError(rank=1, kind="timeout", traceback='  File "/u/case.py", line 7 in shard\n')
    failure = RankFailure("job", [waiting, culprit], timeout_s=3)
    assert failure.culprits == [1] and failure.waiting == [0] and failure.first_rank == 1
    assert "rank(s) 1 did not finish (rank(s) 0 blocked in a collective" in failure.describe(with_traces=False)


def test_rank_failure_survives_pickling():
    import pickle

    failure = RankFailure("job", [RankError(rank=0, kind="raised", exc_type="Unsupported", is_unsupported=True)])
    again = pickle.loads(pickle.dumps(failure))
    assert again.errors == failure.errors and again.label == "job"


def _c(index, kind="all_reduce", nbytes=16, group=(0, 1), group_index=None):
    from sp_harness.launch.wire import Collective

    return Collective(index=index, group_index=index if group_index is None else group_index, kind=kind,
                      nbytes=nbytes, group=group)


def test_the_same_position_with_another_kind_or_size_is_a_desync_naming_both():
    from sp_harness.launch.desync import DesyncWatch

    for theirs in (_c(1, kind="all_gather", nbytes=64), _c(1, nbytes=32)):
        watch = DesyncWatch()
        watch.collective(0, _c(0))
        watch.collective(1, _c(0))
        watch.collective(0, _c(1))
        assert not watch.found
        watch.collective(1, theirs)
        assert [(e.rank, e.kind, e.collective) for e in watch.found] == [(0, "desync", _c(1)), (1, "desync", theirs)]
        failure = RankFailure("job", watch.found)
        assert failure.kind == "desync" and failure.ranks == [0, 1]
        assert failure.describe(with_traces=False).startswith("job: collective desync: rank 0 issued all_reduce of 16 bytes")


def test_uneven_all_to_all_and_other_groups_are_not_a_desync():
    from sp_harness.launch.desync import DesyncWatch

    watch = DesyncWatch()
    watch.collective(0, _c(0, kind="all_to_all", nbytes=8))
    watch.collective(1, _c(0, kind="all_to_all", nbytes=24))
    watch.collective(0, _c(1, group=(0, 2), group_index=0))  # rank 1 is not in that group
    watch.done(1)
    assert not watch.found


def test_a_rank_that_finished_with_fewer_collectives_on_a_group_is_a_desync():
    from sp_harness.launch.desync import DesyncWatch

    watch = DesyncWatch()
    watch.collective(0, _c(0))
    watch.collective(1, _c(0))
    watch.done(1)
    assert not watch.found
    watch.collective(0, _c(1))
    assert [(e.rank, e.collective) for e in watch.found] == [(0, _c(1)), (1, None)]
    assert "finished the job after 1 collective(s) on ranks 0,1" in watch.found[1].detail


def test_a_stall_is_a_desync_only_when_every_pending_rank_waits_in_a_collective():
    from sp_harness.launch.desync import DesyncWatch

    watch = DesyncWatch(stall_s=2.0)
    for rank in (0, 1):
        watch.heard(rank, 0.0)
    watch.collective(0, _c(0))
    assert not watch.should_probe({0, 1}, 1.0)  # not silent long enough
    assert watch.should_probe({0, 1}, 2.5)
    watch.probed({0, 1}, waiting={0})  # rank 1 is computing: it may still get there
    assert not watch.found
    assert not watch.should_probe({0, 1}, 3.0)  # looked 0.5 s ago
    watch.heard(1, 3.0)
    assert not watch.should_probe({0, 1}, 4.5)  # rank 1 spoke 1.5 s ago
    assert watch.should_probe({0, 1}, 5.0)
    watch.probed({0, 1}, waiting={0, 1})
    assert not watch.found  # one look: an announcement may still be on its way
    watch.heard(1, 5.5)  # and one arrived: the look before it proves nothing
    assert watch.should_probe({0, 1}, 7.5)
    watch.probed({0, 1}, waiting={0, 1})
    assert not watch.found
    assert not watch.should_probe({0, 1}, 8.0)
    assert watch.should_probe({0, 1}, 9.5)
    watch.probed({0, 1}, waiting={0, 1})  # the same stall, confirmed with nothing heard between
    assert [(e.rank, e.collective) for e in watch.found] == [(0, _c(0)), (1, None)]
    assert "blocked in an unannounced collective" in watch.found[1].detail


def test_a_stall_whose_stacks_move_between_looks_is_not_a_desync():
    """A rank inside c10d's Python (pickling a payload, checking arguments) is found waiting at
    each look but is working: its stack moves, and it may still announce."""
    from sp_harness.launch.desync import DesyncWatch

    watch = DesyncWatch(stall_s=2.0)
    for rank in (0, 1):
        watch.heard(rank, 0.0)
    watch.collective(0, _c(0))
    blocked = ['File "/v/torch/distributed/distributed_c10d.py", line 9 in all_to_all_single']
    assert watch.should_probe({0, 1}, 2.5)
    watch.probed({0, 1}, waiting={0, 1}, frames={0: blocked, 1: ['File "/v/distributed_c10d.py", line 3 in _object']})
    assert watch.should_probe({0, 1}, 4.5)
    watch.probed({0, 1}, waiting={0, 1}, frames={0: blocked, 1: ['File "/v/distributed_c10d.py", line 7 in _object']})
    assert not watch.found  # rank 1 moved
    assert watch.should_probe({0, 1}, 6.5)
    watch.probed({0, 1}, waiting={0, 1}, frames={0: blocked, 1: ['File "/v/distributed_c10d.py", line 7 in _object']})
    assert [(e.rank, e.collective) for e in watch.found] == [(0, _c(0)), (1, None)]  # frozen: a desync


def test_even_counts_never_ask_for_stacks():
    from sp_harness.launch.desync import DesyncWatch

    watch = DesyncWatch()
    watch.heard(0, 0.0)
    watch.heard(1, 0.0)
    watch.collective(0, _c(0))
    watch.collective(1, _c(0))
    assert not watch.should_probe({0, 1}, 10.0)


def test_waiting_in_collective_reads_c10d_and_functional_waits_not_dtensor_compute():
    from sp_harness.launch.failure import waiting_in_collective

    c10d = '  File "/v/torch/distributed/distributed_c10d.py", line 9 in all_reduce\n  File "/u/m.py", line 1 in f\n'
    funcol = '  File "/v/torch/distributed/_functional_collectives.py", line 9 in wait_tensor\n'
    dtensor = '  File "/v/torch/distributed/tensor/_sharding_prop.py", line 9 in propagate\n'
    assert waiting_in_collective(c10d) and waiting_in_collective(funcol)
    assert not waiting_in_collective(dtensor) and not waiting_in_collective("")


def test_a_desync_error_survives_pickling():
    import pickle

    failure = RankFailure("job", [RankError(rank=1, kind="desync", collective=_c(3))])
    assert pickle.loads(pickle.dumps(failure)).errors == failure.errors


def test_point_to_point_is_not_announced_so_a_send_and_its_recv_never_look_desynced():
    from sp_harness.launch import announce

    class Pipe:
        sent = []

        def send(self, msg):
            self.sent.append(msg)

    pipe = Pipe()
    announce.open_job(pipe, 7)
    try:
        announce.collective("send", 16, (0, 1))
        announce.collective("all_reduce", 16, (0, 1))
    finally:
        announce.close_job()
    assert [(m.job_id, m.collective.kind, m.collective.index, m.collective.group_index) for m in pipe.sent] == [
        (7, "all_reduce", 0, 0)]
