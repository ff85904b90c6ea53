"""Prompts on which n-gram lookup drafts get accepted (tests/engine/test_lookup.py, tests/engine/test_lookup_methods.py)."""
import torch

# Text the small_vocab target sampled itself (exactness_helpers.SAMPLING, seed 4, after
# exactness_helpers.PROMPT[:3]): its patterns recur, so the lookup's drafts are often tokens the target finds
# likely. On exactness_helpers.PROMPT (random) they all land where the target puts no mass, and nothing would
# be accepted.
SELF_SAMPLED = [1, 4, 2, 2, 2, 2, 5, 3, 5, 2, 2, 5, 3, 5, 2, 2, 5, 3, 5, 2, 2, 4, 5]
# 16 random byte-vocabulary tokens three times: after it a random tiny model's greedy text soon repeats itself
REPEATING = torch.randint(3, 259, (16,), generator=torch.Generator().manual_seed(3)).tolist() * 3
