"""The floor of a public form made at run time from one parameter list (issue 30, branch issue30g).

Horovod's ``allreduce`` as a plain ``def`` against the same call through a made form: a
wrapper that reads the parameters after the tensor with one private function (the list
declared once) and hands them to the body. No work in any of them: what is timed is the
calls alone, best of 7 x 200,000. Both functions are compiled from one parameter string.
"""

import timeit
from collections.abc import Callable
from typing import Any

PARAMETERS = (
    "average=None, name=None, compression=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=None"
)
NAMES = ", ".join(p.split("=")[0] for p in PARAMETERS.split(", "))
SOURCE = f"def plain(tensor, {PARAMETERS}):\n    return tensor\ndef tail({PARAMETERS}):\n    return ({NAMES})\n"


def main() -> None:
    space: dict[str, Any] = {}
    exec(SOURCE, space)
    plain, tail = space["plain"], space["tail"]

    def body(tensor: object, parameters: tuple[Any, ...]) -> object:
        return tensor

    def form(*args: Any, **kwargs: Any) -> object:
        if args:
            return body(args[0], tail(*args[1:], **kwargs))
        return body(kwargs.pop("tensor"), tail(**kwargs))

    x = object()
    calls: dict[str, Callable[..., object]] = {"plain def": plain, "form -> tail -> body": form}
    for name, f in calls.items():
        best = min(timeit.repeat(lambda f=f: f(x), number=200000, repeat=7)) / 200000
        print(f"{name}: {best * 1e9:.0f} ns a call, best of 7")


if __name__ == "__main__":
    main()
