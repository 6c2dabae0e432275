"""Weights packed once per loaded model (cbgen.model.packs): a second engine on the same model packs nothing, and a
weight changed in place (a merged adapter, say) is packed again."""

from __future__ import annotations

import torch

from cbgen.model import packs


def test_a_pack_is_kept_while_its_weight_is_unchanged():
    weight = torch.nn.Parameter(torch.randn(8, 4), requires_grad=False)
    made = []

    def pack(w):
        made.append(1)
        return w.detach().clone() * 2

    first = packs.kept(weight, "double", pack)
    assert packs.kept(weight, "double", pack) is first and len(made) == 1
    assert packs.kept(weight, "triple", pack) is not first and len(made) == 2  # another layout, its own pack
    with torch.no_grad():
        weight.add_(1.0)  # in place: the version counter moves
    again = packs.kept(weight, "double", pack)
    assert len(made) == 3 and torch.equal(again, (weight * 2).detach())
    other = torch.nn.Parameter(weight.detach().clone(), requires_grad=False)  # equal values, another tensor
    packs.kept(other, "double", pack)
    assert len(made) == 4


def test_a_second_engine_on_the_model_packs_nothing(tiny_model_dir, monkeypatch):
    import cbgen

    calls: list[str] = []
    kept = packs.kept

    def counting(weight, layout, pack):
        def counted(w):
            calls.append(layout)
            return pack(w)

        return kept(weight, layout, counted)

    monkeypatch.setattr(packs, "kept", counting)
    generator = cbgen.Generator(model=str(tiny_model_dir), dtype="float32", batch_invariant=True)
    settings = {"max_new_tokens": 3, "progress": False, "result_cache": False}
    first = generator.generate(["One.", "Two."], **settings)
    packed = len(calls)
    assert packed > 0  # the batch-invariant linear layers packed their weights for the first engine
    second = generator.generate(["One.", "Two."], **settings)
    assert len(calls) == packed  # and the second engine found them packed
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
