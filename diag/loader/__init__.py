"""The data loader: does it keep up with the step, why not, and the smallest setting that does
(`run_loader(cfg)`: the sweep, the decisions, the stall split, the hot lines)."""
from diag.loader.advice import choose_workers, decide, recommend
from diag.loader.experiment import LoaderResult, run_loader
from diag.loader.sweep import sweep_workers

__all__ = ["LoaderResult", "choose_workers", "decide", "recommend", "run_loader", "sweep_workers"]
