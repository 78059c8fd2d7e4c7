"""Held-out evaluation statistics: unbiased pass@k, its bootstrap interval, and the paired gain of a checkpoint
over another on the same problems.

Every interval resamples *clusters* of problems: a problem is its own cluster unless its prompt's metadata
names a `family` (pytasks does: eight instances of "count the numbers above t" are one family). Problems of
one family succeed or fail together, so resampling them one by one would pretend to more independent
evidence than there is and give intervals that are too narrow; resampling whole families does not.

Pure numpy, no model stack, so the evaluate stage, `rlpipe status` and benchmarks/peer_trl.py share one copy.
(reports/html.py keeps its own pass@k: reports may import storage only.)
"""

from __future__ import annotations

import json
from collections import defaultdict
from math import comb

import numpy as np

from schemas.config import data_source_of


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).

    Requires k <= n. With n - c < k every size-k subset holds a correct sample, so the value is 1.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _pass_at_k_by_correct(n: int, k: int) -> np.ndarray:
    """pass@k for c = 0..n correct of n samples, indexed by c: the lookup the bootstrap resamples through."""
    return np.array([pass_at_k(n, c, k) for c in range(n + 1)])


def cluster_weights(cluster_P: np.ndarray | None, problems: int, resamples: int,
                    rng: np.random.Generator) -> np.ndarray:
    """How many times each of P problems is drawn in each of R resamples, (R, P): clusters are drawn with
    replacement (as many draws as there are clusters) and a drawn cluster brings all of its problems. With
    no clusters every problem is its own, which is the ordinary bootstrap over problems."""
    if cluster_P is None:
        cluster_P = np.arange(problems)
    _, index_P = np.unique(np.asarray(cluster_P), return_inverse=True)
    clusters = int(index_P.max()) + 1
    counts_RC = rng.multinomial(clusters, np.full(clusters, 1.0 / clusters), size=resamples)
    return counts_RC[:, index_P]


def _resampled_pass_at_k(
    n_P: np.ndarray, c_P: np.ndarray, k: int, weights_RP: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Weighted mean pass@k of each resample R (`weights_RP`: how often each problem is drawn), each
    problem's n samples drawn again with replacement: its count correct c* ~ Binomial(n, c / n)."""
    n_RP = np.broadcast_to(n_P, weights_RP.shape)
    correct_RP = rng.binomial(n_RP, c_P / n_P, size=weights_RP.shape)
    values_RP = np.empty(correct_RP.shape)
    for n in np.unique(n_P):  # one lookup per sample count (there is usually one)
        where = n_RP == n
        values_RP[where] = _pass_at_k_by_correct(int(n), k)[correct_RP[where]]
    return (values_RP * weights_RP).sum(axis=1) / weights_RP.sum(axis=1)


def bootstrap_pass_at_k(
    n_P: np.ndarray, c_P: np.ndarray, k: int, resamples: int = 2000, seed: int = 0,
    cluster_P: np.ndarray | None = None,
) -> tuple[float, float]:
    """95% percentile interval of mean pass@k over P problems, by a two-level bootstrap.

    Each resample draws the problems' clusters with replacement (`cluster_weights`; by default each problem
    is its own cluster), then each drawn problem's n samples with replacement (c* ~ Binomial(n, c/n)), and
    takes the mean of pass@k(n_p, c*_p, k) over the drawn problems; the interval is the 2.5th and 97.5th
    percentiles of `resamples` such means. Both levels matter: a held-out set has tens of problems and a
    handful of samples each, and both add variance. Problems with fewer than k samples are left out, as in
    `aggregate`. Seeded, so the interval of one evaluation table is reproducible.
    """
    usable = n_P >= k
    n_P, c_P = n_P[usable], c_P[usable]
    if len(n_P) == 0:
        raise ValueError(f"no problem has at least k={k} samples")
    rng = np.random.default_rng(seed)
    weights_RP = cluster_weights(None if cluster_P is None else np.asarray(cluster_P)[usable], len(n_P),
                                 resamples, rng)
    means_R = _resampled_pass_at_k(n_P, c_P, k, weights_RP, rng)
    low, high = np.percentile(means_R, [2.5, 97.5])
    return float(low), float(high)


def bootstrap_pass_at_k_gain(
    n_before_P: np.ndarray, c_before_P: np.ndarray, n_after_P: np.ndarray, c_after_P: np.ndarray, k: int,
    resamples: int = 2000, seed: int = 0, cluster_P: np.ndarray | None = None,
) -> tuple[float, float, float]:
    """(gain, 95% interval low, high) of mean pass@k after minus before, on the same P problems (paired).

    gain = mean_p pass@k(after_p) - mean_p pass@k(before_p). The interval resamples the problems' clusters
    once per resample for both sides (the pairing: a problem that is easy stays easy), and each side's
    samples within a problem independently, as `bootstrap_pass_at_k` does. An interval above 0 is an
    improvement that the problem, family and sample noise of this evaluation does not explain.
    """
    if not (len(n_before_P) == len(c_before_P) == len(n_after_P) == len(c_after_P)):
        raise ValueError("before and after must hold the same problems, in the same order")
    usable = (n_before_P >= k) & (n_after_P >= k)
    if not usable.any():
        raise ValueError(f"no problem has at least k={k} samples on both sides")
    before = n_before_P[usable], c_before_P[usable]
    after = n_after_P[usable], c_after_P[usable]
    gain = float(np.mean([pass_at_k(int(n), int(c), k) for n, c in zip(*after, strict=True)])
                 - np.mean([pass_at_k(int(n), int(c), k) for n, c in zip(*before, strict=True)]))
    rng = np.random.default_rng(seed)
    weights_RP = cluster_weights(None if cluster_P is None else np.asarray(cluster_P)[usable], int(usable.sum()),
                                 resamples, rng)
    gains_R = _resampled_pass_at_k(*after, k, weights_RP, rng) - _resampled_pass_at_k(*before, k, weights_RP, rng)
    low, high = np.percentile(gains_R, [2.5, 97.5])
    return gain, float(low), float(high)


def bootstrap_mean_gain(
    before_P: np.ndarray, after_P: np.ndarray, resamples: int = 2000, seed: int = 0,
    cluster_P: np.ndarray | None = None,
) -> tuple[float, float, float]:
    """(gain, 95% interval low, high) of a per-problem score's mean, after minus before, on the same P problems.

    gain = mean_p (after_p - before_p); the interval is the 2.5th and 97.5th percentiles of that mean over
    `resamples` draws of the problems' clusters with replacement (paired: each draw takes a problem's two
    scores together). For scores that are already means over samples, such as a problem's mean reward.
    """
    if len(before_P) != len(after_P) or len(before_P) == 0:
        raise ValueError("before and after must hold the same, non-empty, list of problems")
    diff_P = np.asarray(after_P, dtype=np.float64) - np.asarray(before_P, dtype=np.float64)
    rng = np.random.default_rng(seed)
    weights_RP = cluster_weights(cluster_P, len(diff_P), resamples, rng)
    means_R = (weights_RP * diff_P).sum(axis=1) / weights_RP.sum(axis=1)
    low, high = np.percentile(means_R, [2.5, 97.5])
    return float(diff_P.mean()), float(low), float(high)


def mean_rewards(rows: list[dict], mode: str = "sampled") -> dict[str, float]:
    """prompt_id -> mean reward of an evaluation table's answers of one mode ("sampled" or "greedy")."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for row in rows:
        if row["mode"] == mode:
            totals[row["prompt_id"]][0] += float(row["reward"])
            totals[row["prompt_id"]][1] += 1
    return {prompt_id: total / n for prompt_id, (total, n) in totals.items()}


def answer_counts(rows: list[dict], mode: str = "sampled") -> dict[str, tuple[int, int]]:
    """prompt_id -> (n answers, c correct) of an evaluation table's answers of one mode ("sampled", or
    "greedy": n = 1, so pass@1 of these counts is greedy accuracy)."""
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for row in rows:
        if row["mode"] == mode:
            counts[row["prompt_id"]][0] += 1
            counts[row["prompt_id"]][1] += int(row["correct"])
    return {prompt_id: (n, c) for prompt_id, (n, c) in counts.items()}


def clusters_of(prompts: list[dict]) -> dict[str, str]:
    """prompt_id -> the cluster the bootstrap resamples it with: its metadata's `family` where it names one
    (pytasks), else the problem itself. `prompts` are rows of a PROMPTS table."""
    return {row["prompt_id"]: str(json.loads(row["metadata"]).get("family", row["prompt_id"])) for row in prompts}


def data_sources_of(prompts: list[dict]) -> dict[str, str]:
    """prompt_id -> its verl `data_source` (schemas.config.data_source_of). `prompts` are rows of a PROMPTS table."""
    return {row["prompt_id"]: data_source_of(json.loads(row["metadata"]), row["dataset"]) for row in prompts}


def splits_by_data_source(prompts: list[dict]) -> dict[str, str] | None:
    """`data_sources_of(prompts)` where grouping by data_source says more than grouping by dataset: two or more
    sources that are not one per dataset (a verl file mixing gsm8k and MATH); None otherwise, so that a run with
    one source, or with one source per file, shows no rows beside its per-dataset ones."""
    sources = data_sources_of(prompts)
    pairs = {(row["dataset"], sources[row["prompt_id"]]) for row in prompts}
    datasets, names = {dataset for dataset, _ in pairs}, {source for _, source in pairs}
    return None if len(names) < 2 or len(pairs) == len(datasets) == len(names) else sources


def _cluster_array(prompt_ids: list[str], clusters: dict[str, str] | None) -> np.ndarray | None:
    return None if clusters is None else np.array([clusters.get(p, p) for p in prompt_ids])


def paired_gains(
    base_rows: list[dict], rows: list[dict], clusters: dict[str, str] | None = None
) -> dict[str, tuple[float, float, float]]:
    """Gains of one checkpoint's evaluation rows over the base model's, each (gain, 95% low, high) paired over
    the problems both evaluated: "pass@1" of the sampled answers, "greedy" accuracy, and the sampled answers'
    mean "reward" (the partial credit training optimizes, which moves before whole problems flip). The
    intervals resample `clusters` (prompt_id -> cluster, `clusters_of`; default: each problem alone). A gain
    whose two sides share no problem is left out."""
    gains: dict[str, tuple[float, float, float]] = {}
    for name, mode in (("pass@1", "sampled"), ("greedy", "greedy")):
        base, counts = answer_counts(base_rows, mode), answer_counts(rows, mode)
        shared = sorted(set(base) & set(counts))
        if shared:
            before_P2, after_P2 = (np.array([source[p] for p in shared]) for source in (base, counts))
            gains[name] = bootstrap_pass_at_k_gain(before_P2[:, 0], before_P2[:, 1], after_P2[:, 0], after_P2[:, 1], 1,
                                                   cluster_P=_cluster_array(shared, clusters))
    base_reward, reward = mean_rewards(base_rows), mean_rewards(rows)
    shared = sorted(set(base_reward) & set(reward))
    if shared:
        gains["reward"] = bootstrap_mean_gain(np.array([base_reward[p] for p in shared]),
                                              np.array([reward[p] for p in shared]),
                                              cluster_P=_cluster_array(shared, clusters))
    return gains


def aggregate(rows: list[dict], ks: list[int], clusters: dict[str, str] | None = None) -> dict[str, float]:
    """Per-dataset summary: greedy accuracy, mean pass@k over prompts with its bootstrap 95% interval
    (`pass@k_ci_low`, `pass@k_ci_high`; resampling `clusters`, see `clusters_of`), the number of clusters
    resampled, mean response length."""
    greedy = [row["correct"] for row in rows if row["mode"] == "greedy"]
    counts = answer_counts(rows)
    n_P = np.array([n for n, _ in counts.values()], dtype=np.int64)
    c_P = np.array([c for _, c in counts.values()], dtype=np.int64)
    cluster_P = _cluster_array(list(counts), clusters)
    prompt_ids = {row["prompt_id"] for row in rows}
    summary: dict[str, float] = {
        "prompts": float(len(prompt_ids)),
        "clusters": float(len({clusters.get(p, p) for p in prompt_ids} if clusters else prompt_ids)),
    }
    if greedy:
        summary["greedy_accuracy"] = float(np.mean(greedy))
    for k in ks:
        values = [pass_at_k(int(n), int(c), k) for n, c in zip(n_P, c_P, strict=True) if n >= k]
        if values:
            summary[f"pass@{k}"] = float(np.mean(values))
            summary[f"pass@{k}_ci_low"], summary[f"pass@{k}_ci_high"] = bootstrap_pass_at_k(
                n_P, c_P, k, cluster_P=cluster_P)
    summary["mean_num_tokens"] = float(np.mean([row["num_tokens"] for row in rows])) if rows else 0.0
    return summary


def multi_turn_summary(rows: list[dict], mode: str) -> dict[str, float]:
    """Per-dataset figures of a multi-turn evaluation (rows of an EVAL v2 table) in `mode` (tool | feedback): mean
    model turns, tool calls per answer, tool error rate (errors / calls; none without a call), and in feedback mode
    `retried_answers`, those whose first attempt failed and that got a second turn (the budget can end a
    conversation before its retry), and `solved_after_retry`, the fraction of those whose final answer is correct
    (none without a retried answer). Tool mode has no retries: neither figure."""
    if not rows:
        return {}
    calls = sum(row["tool_calls"] for row in rows)
    summary = {
        "mean_turns": float(np.mean([row["num_turns"] for row in rows])),
        "tool_calls_per_answer": calls / len(rows),
    }
    if calls:
        summary["tool_error_rate"] = sum(row["tool_errors"] for row in rows) / calls
    if mode == "feedback":
        retried = [row for row in rows if row["first_answer_correct"] is False and row["num_turns"] > 1]
        summary["retried_answers"] = len(retried)
        if retried:
            summary["solved_after_retry"] = sum(bool(row["correct"]) for row in retried) / len(retried)
    return summary
