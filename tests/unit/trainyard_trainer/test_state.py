"""Training state pieces that are not covered by the checkpoint round trip."""


def test_rng_reseed_is_reproducible_and_depends_on_rank_and_step() -> None:
    import torch

    from trainyard.state import RngState

    def draw(rank: int, step: int) -> tuple[float, float]:
        rng = RngState(rank, torch.device("cpu"), seed=3)
        rng.reseed(step)
        return rng.python.random(), torch.rand(1).item()

    assert draw(0, 4) == draw(0, 4)
    assert draw(0, 4) != draw(1, 4) and draw(0, 4) != draw(0, 5)
