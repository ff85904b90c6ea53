"""NgramIndex (tforce/engine/ngram.py): what followed the latest earlier occurrence of the longest suffix
n-gram; its edge cases; and the index, appended one by one and in bulk, rolled back and rebuilt, against a
brute-force search on random sequences."""
import numpy as np
import pytest

from tforce.engine.ngram import BULK, NgramIndex


def brute(tokens: list[int], n_max: int, n_min: int, k: int) -> list[int]:
    """The definition: for n from n_max down, the latest start s with tokens[s:s + n] equal to the last n
    tokens and s + n < L (a token follows it); up to k tokens after it."""
    L = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        for s in range(L - n - 1, -1, -1):
            if tokens[s:s + n] == tokens[L - n:]:
                return tokens[s + n:s + n + k]
    return []


def index_of(tokens, n_max=3, n_min=1) -> NgramIndex:
    index = NgramIndex(n_max, n_min)
    index.extend(tokens)
    return index


def test_no_match_proposes_nothing():
    assert NgramIndex().propose(4) == []
    assert index_of([5]).propose(4) == []
    assert index_of([5, 6, 7]).propose(4) == []


def test_a_match_near_the_end_proposes_only_what_exists():
    assert index_of([5, 1, 2, 5], n_max=1).propose(4) == [1, 2, 5]
    assert index_of([5, 1, 2, 5], n_max=1).propose(2) == [1, 2]


def test_overlapping_match_in_a_run():
    """The last three 7s occur one position earlier too: what follows that is one 7, then the end."""
    assert index_of([9, 7, 7, 7, 7]).propose(5) == [7]


def test_longest_n_first_then_shorter():
    tokens = [1, 2, 9, 3, 2, 8, 1, 2]
    assert index_of(tokens, n_max=2).propose(2) == [9, 3]  # (1, 2) occurred at the start
    assert index_of(tokens, n_max=1).propose(2) == [8, 1]  # (2,) last occurred before 8
    assert index_of([1, 2, 3, 2], n_max=2, n_min=2).propose(2) == []  # (3, 2) never occurred before


def test_the_latest_occurrence_wins():
    assert index_of([1, 5, 1, 6, 1], n_max=1).propose(2) == [6, 1]


def test_rollback_restores_what_the_removed_tokens_hid():
    index = index_of([1, 2, 1, 2])
    assert index.propose(2) == [1, 2]
    index.truncate(2)
    assert index.propose(2) == []
    index.extend([3, 1])
    assert index.propose(2) == [2, 3]


def test_follow_keeps_the_shared_prefix_and_takes_the_rest():
    index = index_of([4, 5, 6, 4, 5, 6, 4])
    index.follow(np.array([4, 5, 6, 4, 8], dtype=np.int64))  # a rejected draft: 5 became 8
    assert index.tokens.tolist() == [4, 5, 6, 4, 8]
    assert index.propose(3) == []
    index.follow(np.array([4, 5, 6, 4, 8, 6], dtype=np.int64))
    assert index.propose(3) == [4, 8, 6]


@pytest.mark.parametrize("n_max, n_min", [(0, 0), (2, 3)])
def test_bad_sizes_are_refused(n_max, n_min):
    with pytest.raises(ValueError):
        NgramIndex(n_max, n_min)


@pytest.mark.parametrize("n_max, n_min", [(3, 1), (4, 2), (1, 1)])
def test_index_equals_brute_force_on_random_sequences(n_max, n_min):
    """Few distinct tokens, so that matches of every length are common; appends of one token to beyond BULK
    (the two ways of indexing), rollbacks of a few tokens and of many (rebuilt), and follow; checked
    after every step for several k."""
    rng = np.random.default_rng(n_max * 10 + n_min)
    for _ in range(60):
        index, ref = NgramIndex(n_max, n_min), []
        for _ in range(25):
            op = rng.random()
            if op < 0.5:
                new = rng.integers(0, 3, int(rng.choice([1, 2, 5, BULK + 7]))).tolist()
                index.extend(new)
                ref += new
            elif op < 0.8:
                cut = int(rng.integers(0, 6)) if rng.random() < 0.7 else int(rng.integers(0, len(ref) + 1))
                ref = ref[:max(len(ref) - cut, 0)]
                index.truncate(len(ref))
            else:
                keep = max(len(ref) - int(rng.integers(0, 9)), 0)
                ref = ref[:keep] + rng.integers(0, 3, int(rng.integers(0, 2 * BULK))).tolist()
                index.follow(np.array(ref, dtype=np.int64))
            assert index.tokens.tolist() == ref
            for k in (1, 3, 8):
                assert index.propose(k) == brute(ref, n_max, n_min, k), (ref, k)
