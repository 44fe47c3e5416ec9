"""`diag train`'s held-out split (diag.qlora.data.train_records): the eval records are never
trained on, every record is trained, held out or counted as dropped, and steps are whole."""

from __future__ import annotations

import json

import pytest

from diag.config import TrainConfig

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from diag.embedded import ensure_assets

    path = tmp_path_factory.mktemp("held") / "d.jsonl"
    path.write_text("".join(json.dumps({"instruction": f"Sort these words {i}.",
                                        "input": "pear apple", "output": "apple pear"}) + "\n"
                            for i in range(41)))
    return path, ensure_assets().model_dir


@pytest.mark.parametrize("records, batch, held, share, seed", [
    (40, 8, 4, 0.1, 0),  # the case: 4 held out, 4 steps of 8, 4 dropped
    (40, 8, 4, 0.1, 7),
    (41, 4, 5, 0.2, 3),  # 9 held out (the share above the batch), 32 in 8 whole steps
    (20, 5, 5, 0.01, 1),  # one eval batch, 3 steps, nothing dropped
])
def test_eval_records_are_never_trained_and_every_record_is_accounted_for(
        source, records, batch, held, share, seed):
    from diag.qlora.data import train_records

    cfg = TrainConfig(records=records, batch_size=batch, eval_batch=held, eval_share=share,
                      seed=seed)
    split = train_records(cfg, *source)
    train, evals = split.train.indices, split.eval.indices
    assert not set(train) & set(evals)
    assert len(evals) == cfg.held_out(records) and len(train) == split.steps_per_epoch * batch
    assert split.dropped == (records - len(evals)) % batch < batch
    assert len(train) + len(evals) + split.dropped == records
    assert set(train) | set(evals) <= set(range(records))
    assert train == sorted(train) and evals == sorted(evals)  # read in the source's order
    # the same seed draws the same records; the split is the seed's, not the source's first
    assert train_records(cfg, *source).eval.indices == evals
    assert evals != list(range(len(evals)))
