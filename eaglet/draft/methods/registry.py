"""The draft methods by name: the one table (`METHODS`, name -> the module that defines its
`METHOD`) and the default (`DEFAULT_METHOD`). A leaf module: the config imports it for
`train.method`'s choices, and `eaglet.draft.methods` for the methods themselves.

Adding a method is its module and one line here. Modules are named by path, as engines are
(`eaglet.engines.registry`), so a stage's code key holds the chosen method's module only: an
edit to DFlash never re-keys an EAGLE-3 run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

METHODS: dict[str, str] = {
    "eagle3": "eaglet.draft.methods.eagle3",
    "dflash": "eaglet.draft.methods.dflash",
    "peagle": "eaglet.draft.methods.peagle",
    "dspark": "eaglet.draft.methods.dspark",
}
DEFAULT_METHOD = "eagle3"  # `train.method`'s default, and what a draft without a label is

if TYPE_CHECKING:
    MethodName = str
else:
    MethodName = Literal[tuple(METHODS)]  # the config's choices (the form's enum)
