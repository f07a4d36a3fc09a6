"""Measured launch choices: the planner inputs that change speed but never results, declared per op as a frozen
dataclass whose fields carry the range a value may take, and read from a section of a launch profile
(ops/profiles.py). The ranges hold what the planners are tested with: any value in them plans compiled variants
on valid launches, so a profile can make a call slower, never wrong."""

import dataclasses


def choice(low, high):
    """A dataclass field for a measured number in [low, high] (a bool field needs no range: plain ``bool``)."""
    return dataclasses.field(metadata={"range": (low, high)})


def read_choices(cls, section, where: str):
    """An instance of ``cls`` (a dataclass of choices) from a profile's section (a dict); ValueError naming
    ``where`` and what does not fit: a missing or unknown choice, a value of the wrong type or out of range."""
    if not isinstance(section, dict):
        raise ValueError(f"{where}: expected an object of choices, got {type(section).__name__}")
    fields = dataclasses.fields(cls)
    names = {field.name for field in fields}
    if missing := sorted(names - section.keys()):
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    if unknown := sorted(section.keys() - names):
        raise ValueError(f"{where}: unknown {', '.join(unknown)}")
    for field in fields:
        value = section[field.name]
        if field.type in (bool, "bool"):
            if not isinstance(value, bool):
                raise ValueError(f"{where}.{field.name}: expected true or false, got {value!r}")
            continue
        low, high = field.metadata["range"]
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{where}.{field.name}: expected an integer in [{low}, {high}], got {value!r}")
    return cls(**section)


def choices_dict(choices) -> dict:
    """A dataclass of choices as a profile's section."""
    return dataclasses.asdict(choices)
