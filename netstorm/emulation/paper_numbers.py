"""The numbers the NetStorm paper reports for its evaluation (Figs. 13-20), transcribed once.

The paper's figures are plots; the numbers below are the ones its text states about each figure, with
where they stand (section of Li et al., "Accelerating Geo-distributed Machine Learning with
Network-Aware Adaptive Tree and Auxiliary Route", IEEE/ACM ToN; the text copy in
``shared/papers/netstorm.txt`` carries no page numbers, so the section and figure name the place).
``netstorm reproduce`` prints each beside what this host measures for the same quantity. The paper's
MXNET baseline is a STAR parameter server at the hub its users pick; "speedup of 180 %" is 2.8x.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PaperNumber:
    figure: str
    """``13`` .. ``20`` (``19a``/``19b`` for the two panels of Fig. 19)."""
    key: str
    """What ``netstorm.emulation.figures`` computes to compare with it."""
    quantity: str
    stated: str
    """As the paper states it."""
    value: float | None
    """As a number in the unit of ``key`` (a ratio for speed-ups), None when the paper gives a range or
    a trend only."""
    source: str


PAPER: tuple[PaperNumber, ...] = (
    PaperNumber("13", "speedup_static", "NetStorm over MXNET, static network", "up to 9.2x", 9.2,
                "Sec. IX-B, text on Fig. 13; abstract (6.5~9.2x)"),
    PaperNumber("13", "speedup_dynamic", "NetStorm over MXNET, dynamic network", "6.5x", 6.5,
                "Sec. IX-B, text on Fig. 13"),
    PaperNumber("14", "fapt_over_star", "best topology (FAPT, one root) over STAR", "up to 6.7x", 6.7,
                "Sec. IX-C (1), text on Fig. 14"),
    PaperNumber("14", "fapt_over_bkt_static", "FAPT over a balanced tree (BKT)", "210 % speedup (3.1x)", 3.1,
                "Sec. IX-C (1), text on Fig. 14"),
    PaperNumber("14", "fapt_over_bkt_dynamic", "adaptive FAPT over static BKT, dynamic network",
                "70 % speedup (1.7x)", 1.7, "Sec. IX-C (1), text on Fig. 14"),
    PaperNumber("15", "roots_9_over_1", "throughput with 9 roots over 1 root (dynamic, aux. paths on)",
                "180 % speedup (2.8x), rising linearly with the roots", 2.8, "Sec. IX-C (2), text on Fig. 15"),
    PaperNumber("16", "awareness_off_s", "mean iteration time, awareness off", "66 s", 66.0,
                "Sec. IX-C (3), text on Fig. 16"),
    PaperNumber("16", "awareness_on_s", "mean iteration time, awareness on", "50 s", 50.0,
                "Sec. IX-C (3), text on Fig. 16"),
    PaperNumber("16", "awareness_gain", "training speed gained by awareness", "24 %", 0.24,
                "Sec. IX-C (3), text on Fig. 16"),
    PaperNumber("17", "aux_gain_min", "auxiliary-path gain (Eq. 15), lowest over the grid", "30 %", 0.30,
                "Sec. IX-C (4), text on Fig. 17"),
    PaperNumber("17", "aux_gain_max", "auxiliary-path gain (Eq. 15), highest over the grid", "65 %", 0.65,
                "Sec. IX-C (4), text on Fig. 17; Sec. X"),
    PaperNumber("17", "aux_best_cell", "best PRIMARY_BUSY_BOUND, AUXILIARY_QUEUE_LENGTH", "2, 5", None,
                "Sec. IX-C (4), text on Fig. 17"),
    PaperNumber("18", "lite_over_mxnet", "NetStorm-lite over MXNET", "5.5x", 5.5, "Sec. IX-C (5), text on Fig. 18"),
    PaperNumber("18", "std_over_lite", "NetStorm-std over NetStorm-lite", "+20 % throughput", 0.20,
                "Sec. IX-C (5), text on Fig. 18; Sec. X"),
    PaperNumber("18", "pro_over_mxnet", "NetStorm-pro over MXNET", "7.5x", 7.5, "Sec. IX-C (5), text on Fig. 18"),
    PaperNumber("19a", "model_trend", "iteration time against model size",
                "both rise with the model; NetStorm's rises more gradually than MXNET's", None,
                "Sec. IX-D, text on Fig. 19a"),
    PaperNumber("19b", "scaling_efficiency", "scaling efficiency from 5 to 15 DCs (roots = DCs)", "0.93", 0.93,
                "Sec. IX-D, text on Fig. 19b"),
    PaperNumber("20", "chunk_size_best", "best CHUNK_SIZE (AlexNet, 61 M parameters)",
                "0.5~1 M parameters; larger chunks lose throughput sharply", None, "Sec. IX-E, text on Fig. 20"),
    PaperNumber("20", "update_time_best", "best UPDATE_TIME", "5 s", 5.0, "Sec. IX-E, text on Fig. 20"),
    PaperNumber("20", "probe_chunk_num_range", "recommended PROBE_CHUNK_NUM", "4 to 32 (less sensitive)", None,
                "Sec. IX-E, text on Fig. 20"),
    PaperNumber("20", "probe_chunk_size_range", "recommended PROBE_CHUNK_SIZE", "0.01 to 4 M parameters", None,
                "Sec. IX-E, text on Fig. 20"),
)


def for_figure(figure: str) -> list[PaperNumber]:
    return [n for n in PAPER if n.figure == figure]


def by_key(key: str) -> PaperNumber:
    for number in PAPER:
        if number.key == key:
            return number
    raise KeyError(key)
