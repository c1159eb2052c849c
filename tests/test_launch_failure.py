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
    assert failure.describe(with_traces=False) == "job: rank 1 killed by SIGSEGV; rank(s) 0 raised"
    assert failure.summary_line() == 'rank 1 at File "/u/case.py", line 3 in shard'


def test_a_nonzero_exit_is_exited_not_signal():
    err = process_ended(2, 3, log_tail="some output\nlast words")
    assert (err.kind, err.exit_code, err.signal_name) == ("exited", 3, "")
    assert RankFailure("job", [err]).summary_line() == "last words"


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
