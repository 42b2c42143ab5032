"""GPU phase signatures: which step phase a GPU sample shows, learned online per job.

Private helper of `perfloop.streams.phases`. A GPU sample becomes a feature vector of four
numbers in 0..1 (`FEATURES`): SM utilisation, memory utilisation, power as a share of the power
limit, and NVLink traffic as a share of the job's link scale (its 99th percentile over the recent
samples, fixed at each clustering so that signatures and samples stay comparable; the most seen
so far before the first). A `SignatureLibrary` maps
vectors to the step phases of `STEP_PHASES`:

- with labels (the job also publishes phase spans): each phase's signature is the running mean
  of the samples its spans cover; a sample is classified to the nearest signature, and the
  library counts how often that prediction, made before the label arrived, was right;
- without labels: the library clusters its recent samples (k-means++ with k = 5 to 8: clusters
  beyond one per phase take the samples that straddle a phase boundary; close clusters merged; a
  cluster lying between two others is such a mixture and takes the nearer one's name; of the
  candidates, the one with one pure cluster per phase, or nearest that, that best explains every
  sample as one phase or a blend of two wins) and names the pure clusters by physics: the GPU
  idles while the input pipeline is late (lowest SM → ``data_wait``), NCCL kernels use few SMs
  and move the links (highest link traffic at lower SM → ``comm``), the optimizer is memory-bound
  (memory ahead of SM → ``optimizer``), and of the compute clusters the one drawing the most
  power (plus half its link traffic: gradient buckets leave during backward) is ``backward``, the
  others ``forward``. A single compute cluster —
  a sampling interval longer than the phases averages them all — is ``backward`` when gradients
  move during it (backward is the longest phase of a step), else ``forward``;
- before the first clustering, generic priors (`PRIORS`) classify.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "FEATURES",
    "PRIORS",
    "STEP_PHASES",
    "SignatureLibrary",
    "cluster_labels",
    "gpu_features",
    "kmeans",
]

STEP_PHASES = ("data_wait", "forward", "backward", "comm", "optimizer")
FEATURES = ("sm", "mem", "power", "link")
DATA_WAIT, FORWARD, BACKWARD, COMM, OPTIMIZER = range(5)
PRIORS = np.array(
    [
        [0.05, 0.05, 0.20, 0.0],  # data_wait: idle
        [0.90, 0.40, 0.80, 0.0],  # forward
        [0.90, 0.50, 0.90, 0.2],  # backward
        [0.50, 0.20, 0.40, 0.8],  # comm
        [0.60, 0.80, 0.50, 0.0],  # optimizer
    ]
)
"""Generic signatures (rows: `STEP_PHASES`, columns: `FEATURES`), used until a job has its own."""

CLUSTERS = len(STEP_PHASES) + 3  # at most: the extra ones take samples straddling boundaries
CLUSTER_SAMPLES = 768  # the buffer is thinned to about this many for clustering
MERGE_DISTANCE = 0.2  # clusters closer than this are one (separable phases differ by ≥ 0.25)
MIXTURE_DISTANCE = 0.08  # a cluster this close to the segment between two others mixes them,
MIXTURE_SHARE = 0.12  # or this share of the segment's length when that is more
IDLE_SM = 0.35
COMM_LINK = 0.5
COMM_SM_BELOW = 0.15


def gpu_features(cols: dict[str, np.ndarray]) -> np.ndarray:
    """Raw feature vectors (n, 4) of GPU sample columns: the link column in bytes/s (a
    `SignatureLibrary` scales it, `SignatureLibrary.features`)."""
    limit = cols["power_limit_w"]
    share = np.where(limit > 0, cols["power_w"] / np.where(limit > 0, limit, 1.0), 0.0)
    x = np.empty((len(limit), 4))
    x[:, 0] = cols["sm_util_pct"] / 100.0
    x[:, 1] = cols["mem_util_pct"] / 100.0
    x[:, 2] = np.minimum(share, 1.0)
    x[:, 3] = cols["nvlink_rx_bytes_per_s"] + cols["nvlink_tx_bytes_per_s"]
    return x


def _d2(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Squared distances (n, k), as |x|² − 2 x·c + |c|² (one matrix product)."""
    d = (x * x).sum(axis=1)[:, None] - 2.0 * (x @ c.T) + (c * c).sum(axis=1)[None, :]
    return np.maximum(d, 0.0)


def _lloyd(x: np.ndarray, cent: np.ndarray, iters: int) -> tuple[np.ndarray, float]:
    for _ in range(iters):
        lab = _d2(x, cent).argmin(axis=1)
        n = np.bincount(lab, minlength=len(cent))
        sums = np.stack(
            [np.bincount(lab, weights=x[:, j], minlength=len(cent)) for j in range(x.shape[1])]
        )
        new = np.where(n[:, None] > 0, sums.T / np.maximum(n, 1)[:, None], cent)
        if np.allclose(new, cent, atol=1e-4):
            cent = new
            break
        cent = new
    return cent, float(_d2(x, cent).min(axis=1).sum())


def kmeans(
    x: np.ndarray,
    k: int,
    *,
    init: np.ndarray | None = None,
    restarts: int = 3,
    iters: int = 25,
    seed: int = 0,
) -> np.ndarray:
    """Centroids of ``x`` by Lloyd's algorithm: the best of ``restarts`` k-means++ starts
    (seeded) and ``init`` when given, by within-cluster sum of squares (``init`` kept unless
    beaten by 5%, so that a job's clusters stay stable).

    >>> x = np.array([[0.0, 0.0], [0.1, 0.0], [1.0, 1.0], [0.9, 1.0]])
    >>> np.round(sorted(kmeans(x, 2).tolist()), 2).tolist()
    [[0.05, 0.0], [0.95, 1.0]]
    """
    rng = np.random.default_rng(seed)
    starts = [init.copy()] if init is not None else []
    for _ in range(restarts):
        c = [x[int(rng.integers(len(x)))]]
        for _ in range(k - 1):
            d = _d2(x, np.array(c)).min(axis=1)
            if d.sum() <= 0:
                break
            c.append(x[int(rng.choice(len(x), p=d / d.sum()))])
        starts.append(np.array(c))
    runs = [_lloyd(x, c, iters) for c in starts]
    best = min(runs, key=lambda r: r[1])
    if init is not None and runs[0][1] <= 1.05 * best[1]:
        return runs[0][0]  # keep the clusters the job had unless others fit clearly better
    return best[0]


def _merge(cent: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge the closest pair of clusters while it is closer than `MERGE_DISTANCE`."""
    c, w = list(cent), list(n.astype(float))
    while len(c) > 1:
        arr = np.array(c)
        d = np.sqrt(_d2(arr, arr))
        np.fill_diagonal(d, np.inf)
        i, j = np.unravel_index(int(np.argmin(d)), d.shape)
        if d[i, j] >= MERGE_DISTANCE:
            break
        total = w[i] + w[j]
        c[i] = (c[i] * w[i] + c[j] * w[j]) / max(total, 1.0)
        w[i] = total
        del c[j], w[j]
    return np.array(c), np.array(w)


def _mixtures(cent: np.ndarray) -> dict[int, int]:
    """Clusters that lie between two others (samples straddling a phase boundary average the
    two phases), each with the cluster it is nearer to."""
    out: dict[int, int] = {}
    k = len(cent)
    for m in range(k):
        best: tuple[float, int] | None = None
        for a in range(k):
            for b in range(a + 1, k):
                if m in (a, b):
                    continue
                ab = cent[b] - cent[a]
                span = float(ab @ ab)
                if span <= 0:
                    continue
                lam = float((cent[m] - cent[a]) @ ab) / span
                dist = float(np.sqrt(((cent[a] + lam * ab - cent[m]) ** 2).sum()))
                near = max(MIXTURE_DISTANCE, MIXTURE_SHARE * np.sqrt(span))
                between = 0.15 < lam < 0.85 and dist < near
                if between and (best is None or dist < best[0]):
                    best = (dist, a if lam < 0.5 else b)
        if best is not None:
            out[m] = best[1]
    return {m: e for m, e in out.items() if e not in out}


def segment_residual(x: np.ndarray, pure: np.ndarray) -> float:
    """Mean distance of the samples to the nearest segment between two pure signatures (or
    to the nearest one): how well "each sample is one phase or a blend of two" explains them."""
    best = np.sqrt(_d2(x, pure).min(axis=1))
    for a in range(len(pure)):
        for b in range(a + 1, len(pure)):
            ab = pure[b] - pure[a]
            lam = np.clip(((x - pure[a]) @ ab) / max(float(ab @ ab), 1e-12), 0.0, 1.0)
            d = np.sqrt(((pure[a] + lam[:, None] * ab - x) ** 2).sum(axis=1))
            best = np.minimum(best, d)
    return float(best.mean())


def best_clustering(x: np.ndarray, init: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """Centroids and phase codes: of k-means runs with k = 5..8, the one whose pure
    (non-mixture) clusters are closest to one per phase, then the smallest `segment_residual`."""
    best: tuple[tuple[int, float], np.ndarray, np.ndarray] | None = None
    for k in range(len(STEP_PHASES), CLUSTERS + 1):
        if k > len(x):
            break
        start = init if init is not None and len(init) == k else None
        cent = kmeans(x, k, init=start, restarts=2)
        n = np.bincount(_d2(x, cent).argmin(axis=1), minlength=len(cent))
        cent, n = _merge(cent[n > 0], n[n > 0])
        mix = _mixtures(cent)
        pure = [i for i in range(len(cent)) if i not in mix]
        score = (-abs(len(pure) - len(STEP_PHASES)), -segment_residual(x, cent[pure]))
        if best is None or score > best[0]:
            best = (score, cent, name_clusters(cent, mix))
    assert best is not None
    return best[1], best[2]


def name_clusters(cent: np.ndarray, mix: dict[int, int] | None = None) -> np.ndarray:
    """Phase code of each cluster: mixtures take their nearer end's, the rest `cluster_labels`."""
    mix = _mixtures(cent) if mix is None else mix
    pure = [i for i in range(len(cent)) if i not in mix]
    lab = np.full(len(cent), -1)
    lab[pure] = cluster_labels(cent[pure])
    for m, end in mix.items():
        lab[m] = lab[end]
    return lab


def cluster_labels(cent: np.ndarray) -> np.ndarray:
    """Name clusters (rows of ``cent``) by the physics of each phase; see the module docstring.

    >>> cluster_labels(np.array([[0.9, 0.4, 0.8, 0.0], [0.05, 0.0, 0.2, 0.0]])).tolist()
    [1, 0]
    """
    lab = np.full(len(cent), -1)
    rest = list(range(len(cent)))
    top_sm = float(cent[:, 0].max())
    idle = min(rest, key=lambda k: cent[k, 0])
    if cent[idle, 0] < IDLE_SM:
        lab[idle] = DATA_WAIT
        rest.remove(idle)
    if rest:
        comm = max(rest, key=lambda k: cent[k, 3])
        if cent[comm, 3] >= COMM_LINK and cent[comm, 0] <= top_sm - COMM_SM_BELOW:
            lab[comm] = COMM
            rest.remove(comm)
    if len(rest) > 1:
        opt = max(rest, key=lambda k: cent[k, 1] - cent[k, 0])
        if cent[opt, 1] - cent[opt, 0] > -0.05:
            lab[opt] = OPTIMIZER
            rest.remove(opt)
    rest.sort(key=lambda k: cent[k, 2] + 0.5 * cent[k, 3])
    if len(rest) == 1:
        lab[rest[0]] = BACKWARD if cent[rest[0], 3] > 0.1 else FORWARD
    elif rest:
        lab[rest[-1]] = BACKWARD
        lab[rest[:-1]] = FORWARD
    return lab


class SignatureLibrary:
    """One job's phase signatures; see the module docstring.

    >>> lib = SignatureLibrary()
    >>> x = np.array([[0.02, 0.01, 0.15, 0.0], [0.95, 0.45, 0.8, 0.0]])
    >>> [STEP_PHASES[i] for i in lib.classify(x)[0]]
    ['data_wait', 'forward']
    """

    def __init__(
        self,
        *,
        buffer: int = 2048,
        window_s: float = 20.0,
        min_cover_s: float = 10.0,
        recluster_s: float = 120.0,
        min_samples: int = 256,
    ) -> None:
        self.buffer = buffer
        self.window_s = window_s
        self.min_cover_s = min_cover_s
        self.recluster_s = recluster_s
        self.min_samples = min_samples
        self.centroids = PRIORS.copy()
        self.labels = np.arange(len(STEP_PHASES))
        self.source = "prior"  # prior, clusters, labels
        self._ring = np.zeros((buffer, 4))
        self._ring_t = np.zeros(buffer, np.int64)
        self._seen = 0  # samples kept in the ring, ever
        self._count = 0  # samples offered, ever
        self._rate = 0.0  # samples per second offered (exponential mean)
        self._last_t = 0
        self._since = 0
        self._novel = 0
        self._clustered_t = 0
        self.lab_sum = np.zeros((len(STEP_PHASES), 4))
        self.lab_n = np.zeros(len(STEP_PHASES))
        self.correct = 0
        self.scored = 0
        self.link_scale = 0.0

    @property
    def accuracy(self) -> float:
        """Share of samples classified right before their span label arrived (NaN: none yet)."""
        return self.correct / self.scored if self.scored else float("nan")

    def features(self, raw: np.ndarray) -> np.ndarray:
        """Scale raw vectors (`gpu_features`) by the job's link scale, widening it before the
        first clustering."""
        x = raw.copy()
        if self.source == "prior" and len(raw):
            self.link_scale = max(self.link_scale, float(raw[:, 3].max()))
        x[:, 3] = raw[:, 3] / self.link_scale if self.link_scale > 0 else 0.0
        return x

    def classify(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Phase code of each vector, and a 0..1 confidence (1 − nearest / second distance)."""
        codes, conf, _ = self.classify_full(x)
        return codes, conf

    def classify_full(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`classify`, plus each vector's squared distance to its nearest signature."""
        if not len(x):
            return np.empty(0, np.int64), np.empty(0), np.empty(0)
        d = _d2(x, self.centroids)
        near = d.argmin(axis=1)
        if d.shape[1] > 1:
            part = np.partition(d, 1, axis=1)
            conf = 1.0 - np.sqrt(part[:, 0] / np.maximum(part[:, 1], 1e-12))
            nearest = part[:, 0]
        else:
            conf, nearest = np.ones(len(x)), d[:, 0]
        return self.labels[near], np.clip(conf, 0.0, 1.0), nearest

    def add_unlabelled(self, raw: np.ndarray, nearest_d2: np.ndarray, ts: np.ndarray) -> None:
        """Remember raw samples for clustering and re-cluster when due; see `due`.

        The ring keeps an evenly thinned sample of the last ``window_s`` seconds, whatever the
        job's size: every k-th sample offered, k from the rate they come at.
        """
        n = len(raw)
        if not n or self.source == "labels":
            return
        t_hi = int(ts.max())
        if self._last_t and t_hi > self._last_t:
            rate = n / ((t_hi - self._last_t) / 1e9)
            self._rate = rate if not self._rate else 0.8 * self._rate + 0.2 * rate
        self._last_t = max(self._last_t, t_hi)
        stride = max(1, int(self._rate * self.window_s / self.buffer))
        keep = (self._count + np.arange(n)) % stride == 0
        self._count += n
        kept = raw[keep][-self.buffer :]
        idx = (self._seen + np.arange(len(kept))) % self.buffer
        self._ring[idx] = kept
        self._ring_t[idx] = ts[keep][-self.buffer :]
        self._seen += len(kept)
        self._since += n
        self._novel += int((nearest_d2 > MERGE_DISTANCE**2).sum())
        if self.due():
            self.recluster()
            self._clustered_t = self._last_t

    def due(self) -> bool:
        """Whether to cluster now: first once the ring covers ``min_cover_s`` (a few steps),
        then every ``recluster_s``, or sooner when many samples fit no signature (samples that
        straddle a phase boundary fit none either, so it takes 40% of those since)."""
        filled = min(self._seen, self.buffer)
        if filled < self.min_samples:
            return False
        if self.source == "prior":
            t = self._ring_t[:filled]
            return int(t.max()) - int(t.min()) >= self.min_cover_s * 1e9
        if self._last_t - self._clustered_t >= self.recluster_s * 1e9:
            return True
        return self._since >= 1024 and self._novel >= 0.4 * self._since

    def recluster(self) -> None:
        """Cluster the buffered samples (a spread subsample) and name the clusters."""
        x = self._ring[: min(self._seen, self.buffer)]
        x = x[:: max(1, len(x) // CLUSTER_SAMPLES)].copy()
        link = x[:, 3]
        self.link_scale = float(np.percentile(link, 99)) or float(link.max())
        x[:, 3] = link / self.link_scale if self.link_scale > 0 else 0.0
        init = self.centroids if self.source == "clusters" else None
        self.centroids, self.labels = best_clustering(x, init)
        self.source = "clusters"
        self._since = self._novel = 0

    def add_labelled(self, x: np.ndarray, y: np.ndarray, predicted: np.ndarray) -> None:
        """Learn from samples labelled by spans (``y`` phase codes); score the predictions."""
        if not len(y):
            return
        self.correct += int((predicted == y).sum())
        self.scored += len(y)
        n = np.bincount(y, minlength=len(STEP_PHASES)).astype(float)
        sums = np.stack([np.bincount(y, weights=x[:, j], minlength=len(n)) for j in range(4)]).T
        keep = np.minimum(1.0, 500.0 / np.maximum(self.lab_n + n, 1.0))  # forget slowly
        self.lab_sum = (self.lab_sum + sums) * keep[:, None]
        self.lab_n = (self.lab_n + n) * keep
        known = self.lab_n >= 5
        if known.any():
            self.centroids = self.lab_sum[known] / self.lab_n[known][:, None]
            self.labels = np.flatnonzero(known)
            self.source = "labels"

    def state(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SignatureLibrary:
        lib = cls.__new__(cls)
        lib.__dict__.update(state)
        return lib
