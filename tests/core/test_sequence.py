"""SeqState's in-place view of prompt + output (Tokens) against the list it stands for."""

import itertools

import pytest

from edgeinfer.core.sequence import Tokens


@pytest.mark.parametrize(("prompt", "output"), [((), []), ((5,), []), ((), [7]), ((1, 2, 3), [4, 5]),
                                                (tuple(range(10, 27)), list(range(40, 45)))])
def test_tokens_read_as_the_concatenated_list(prompt: tuple[int, ...], output: list[int]) -> None:
    """Every index and every step-1 slice (bounds past either end, negative, reversed) equals the
    same read of [*prompt, *output]; later appends to the output show through."""
    view, whole = Tokens(prompt, output), [*prompt, *output]
    assert len(view) == len(whole) and list(view) == whole
    for i in range(-len(whole) - 2, len(whole) + 2):
        if -len(whole) <= i < len(whole):
            assert view[i] == whole[i]
        else:
            with pytest.raises(IndexError):
                view[i]
    bounds = [None, *range(-len(whole) - 2, len(whole) + 3)]
    for start, stop in itertools.product(bounds, bounds):
        assert view[start:stop] == tuple(whole[start:stop]), (start, stop)
    output.append(99)
    assert view[-1] == 99 and len(view) == len(whole) + 1
    with pytest.raises(ValueError, match="step by 1"):
        view[::2]
