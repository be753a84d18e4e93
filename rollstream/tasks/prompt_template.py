"""A task's system prompt with the instance's values filled in. The prompt may come from the job
(``instance["system_prompt"]``), so only bare ``{name}`` fields of the names the task offers are
filled: no width or precision (``{repo_dir:999999999}`` would build a gigabyte string), no
attribute or index (``{repo_dir.__class__}``), no conversion. ``{{`` and ``}}`` stay literal
braces, as with ``str.format``."""

from __future__ import annotations

import string

from rollstream.errors import InvalidJob


def fill_prompt(template: object, **values: str) -> str:
    """``template`` with each ``{name}`` replaced by ``values[name]``, or InvalidJob naming the
    field it will not fill."""
    if not isinstance(template, str):
        raise InvalidJob(f"system_prompt must be a string, not {type(template).__name__}")
    names = ", ".join("{" + name + "}" for name in values)
    parts: list[str] = []
    try:
        for literal, field, spec, conversion in string.Formatter().parse(template):
            parts.append(literal)
            if field is None:
                continue
            if field not in values or spec or conversion:
                shown = "{" + field + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
                raise InvalidJob(f"system_prompt field {shown[:80]} is not one this task fills; it fills "
                                 f"{names or 'none'}, without format specs (write {{{{ and }}}} for braces)")
            parts.append(values[field])
    except ValueError as exc:  # an unmatched brace
        raise InvalidJob(f"system_prompt is not a valid template ({exc}); write {{{{ and }}}} for literal "
                         "braces") from None
    return "".join(parts)
