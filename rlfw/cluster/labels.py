"""Ray node labels as ``ray start --labels`` takes them (``role=train,zone=a``), or with ``:`` for ``=``.

rlfw's label selectors (``cluster.trainer_label_selector``, ``rollout.engine_label_selector``) use that form, so
the string that labels a node is the string that selects it; ``role:train`` says the same without the quotes that
Hydra's override grammar needs around an ``=`` (``'cluster.trainer_label_selector="role=train"'``). A value may
also be one of Ray's selector operators (``!gpu``, ``in(a,b)``, ``!in(a,b)``), passed to Ray as is.
"""

from __future__ import annotations

import re
from typing import Dict

_PAIR = re.compile(r"^\s*([A-Za-z0-9][-A-Za-z0-9_./]*)\s*[=:]\s*(\S+?)\s*$")


def parse_labels(text: str) -> Dict[str, str]:
    """``"a=1,b:2"`` -> ``{"a": "1", "b": "2"}``; ``""`` -> ``{}``; anything else raises ``ValueError``."""
    labels: Dict[str, str] = {}
    if not text or not text.strip():
        return labels
    for pair in re.split(r",(?![^()]*\))", text):  # commas inside in(...) belong to the value
        match = _PAIR.match(pair)
        if not match:
            raise ValueError(f"{pair.strip()!r} is not key=value or key:value (labels look like role=train,zone=a)")
        labels[match.group(1)] = match.group(2)
    return labels
