"""Scoring a draft into the acceptance estimates: one verified
(:func:`learn`), or one not sent, against the tokens that plain steps commit
(:class:`Shadow`). Both record, for every draft node whose parent was
accepted, whether the node was, under the tags of the sources that proposed
it (:meth:`~mlx_mtp.acceptance.Acceptance.record`)."""

from __future__ import annotations

from .acceptance import Acceptance
from .offers import Item, Offer
from .speculative import Draft, Verified


def learn(
    acc: Acceptance,
    offer: Offer,
    kept: list[Item],
    draft: Draft,
    verified: Verified,
    reset: bool = False,
    calibrate: bool = True,
) -> None:
    """Record a verified step of ``draft`` (the first ``kept`` items of
    ``offer``) into ``acc``: every node whose parent was accepted, the tokens
    each of ``offer.gains`` earned, and (``calibrate``) the whole draft's
    estimate against its accepted length. ``reset``: a whole draft accepted
    (a probe's) forgets the estimates first (the text changed)."""
    path = verified.path
    if calibrate and acc.calibration is not None and any(it.node for it in kept):
        acc.calibration.record(sum(it.value for it in kept if it.node), len(path))
    if not draft.tags:
        return
    if reset and draft.drafted and len(path) == draft.drafted:
        acc.reset()
    on_path = {0, *path}
    parents = draft.parent_slots()
    gained = dict.fromkeys(offer.gains, 0)
    for i, tags in enumerate(draft.tags):
        if int(parents[i + 1]) in on_path:
            hit = i + 1 in on_path
            acc.record(tags, hit)
            for name in {t[0] for t in tags} & gained.keys() if hit else ():
                gained[name] += 1
    for name, tokens in gained.items():
        acc.record_gain(name, tokens)


class Shadow:
    """A draft not sent, scored against the tokens that plain steps commit
    exactly as verification would have scored it: every node whose parent
    was accepted is recorded, accepted or not, and the walk goes on along
    the child that matches the committed token.

    Args:
        draft: the draft (its verified slots are scored).
        predicted: the sum of its nodes' estimates (for the calibration).
        gains: sources whose accepted tokens per draft are learned.
    """

    def __init__(self, draft: Draft, predicted: float, gains: tuple[str, ...]):
        n = draft.n_verify
        self.tokens, self.tags = draft.tokens[:n].tolist(), draft.tags or []
        self.parents = draft.parent_slots()[:n].tolist()
        self.predicted, self.node, self.depth = predicted, 0, 0
        self.gained = dict.fromkeys(gains, 0)

    @classmethod
    def of(cls, offer: Offer, items: list[Item]) -> Shadow | None:
        """The shadow of an offer's ``items`` (None where the offer is not
        free, or drafts nothing)."""
        if not offer.free or not items or offer.build is None:
            return None
        draft = offer.build(len(items))
        if not draft.tags or not draft.drafted:
            return None
        return cls(draft, sum(it.value for it in items if it.node), tuple(offer.gains))

    def score(self, token: int, acc: Acceptance) -> bool:
        """Score the next committed token; False once the walk has ended."""
        hit = None
        for slot in range(1, len(self.tokens)):
            if self.parents[slot] == self.node and slot - 1 < len(self.tags):
                ok = hit is None and self.tokens[slot] == token
                acc.record(self.tags[slot - 1], ok)
                if ok:
                    hit = slot
                    for name in {t[0] for t in self.tags[slot - 1]} & self.gained.keys():
                        self.gained[name] += 1
        if hit is not None:
            self.node, self.depth = hit, self.depth + 1
            return True
        if acc.calibration is not None and self.predicted > 0:
            acc.calibration.record(self.predicted, self.depth)
        for name, tokens in self.gained.items():
            acc.record_gain(name, tokens)
        return False
