"""Chi-square goodness of fit of observed token counts against an exact distribution."""
from __future__ import annotations

import numpy as np
from scipy.stats import chisquare


def chi2_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """counts (K,) observed, probs (K,) exact; cells expected under min_expected are pooled."""
    counts = np.asarray(counts, dtype=float)
    probs = np.asarray(probs, dtype=float)
    probs = probs / probs.sum()
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0  # mass where the target has none
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)
