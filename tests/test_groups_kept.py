"""stashpoint's own process groups over a job's life: managers opened one after another share
them, ``shutdown()`` frees them all, and a manager open across a ``shutdown()`` goes on."""

from __future__ import annotations

from pathlib import Path


def test_managers_one_after_another_share_their_groups_and_survive_a_shutdown(tmp_path):
    """Before: each manager with preemption handling or a remote tier made a gloo group of its
    own that nothing destroyed (20 managers: 21 groups, ~40 sockets per rank); and a
    ``shutdown()`` while one was open failed every later upload, blaming a peer, so steps were
    never uploaded and the local retention kept them all."""
    from dist_util import run_world

    worker = Path(__file__).with_name("groups_worker.py")
    for r in run_world(2, str(tmp_path), worker=worker, timeout=300):
        assert r["cycled"] == 3, r  # the saves', the preemption's and the uploads' groups, once each
        assert r["after_shutdown"] == 0, r
        assert r["local"] == [3] and r["remote"] == [1, 2, 3], r


def test_a_torch_that_ignores_lazy_gloo_connection_is_said_once(monkeypatch, caplog):
    """torch reads TORCH_GLOO_LAZY_INIT from 2.8 on; the range allows 2.6, where a large
    stashpoint group would connect every pair of ranks without a word."""
    import logging

    import torch

    from stashpoint._dist import gloo

    monkeypatch.setattr(gloo, "_eager_said", False)
    with caplog.at_level(logging.WARNING, logger="stashpoint"):
        monkeypatch.setattr(torch, "__version__", "2.8.0a0+git1234")
        gloo._warn_if_eager()
        assert not caplog.text, "2.8 connects lazily"
        monkeypatch.setattr(torch, "__version__", "2.7.1+cu126")
        gloo._warn_if_eager()
        gloo._warn_if_eager()
    assert caplog.text.count("torch 2.7.1+cu126 connects every pair of ranks") == 1
