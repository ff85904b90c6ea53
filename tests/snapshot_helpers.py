"""What the KV snapshot tests share (tests/snapshot/test_snapshot.py, tests/snapshot/test_batch_snapshot.py): every method, and
the greedy options their snapshots are made and used with."""
from exactness_helpers import SMALL

METHODS = ["ar", "triforce", "retrieval", "streaming", "naive"]
GREEDY = dict(max_new_tokens=24, temperature=0, ignore_eos=True, rebuild_every=8, **SMALL)
