"""Which column of an imported table holds each role (``recsvc data import --columns`` / ``--item-columns``).

A :class:`Columns` is the table of defaults of one kind of table (role -> column name) and, once the command
line's ``ROLE=COLUMN`` pairs are applied (:meth:`Columns.given`), the roles named there: a named column must
exist, a defaulted optional one is read only when present.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from training.data.tabular import Table


@dataclass(frozen=True)
class Columns:
    """``names[role]``: the column of each role; ``flag``: the option that renames them; ``named``: the roles
    given on the command line; ``labels[role]``: how an error names the role (default: the role)."""

    flag: str
    names: Mapping[str, str]
    named: frozenset[str] = frozenset()
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.names)

    def __getitem__(self, role: str) -> str:
        return self.names[role]

    def given(self, mapping: Mapping[str, str]) -> Columns:
        """These columns with ``mapping``'s roles renamed (and marked named); a ValueError names an unknown role."""
        for role in mapping:
            self._check_role(role)
        return replace(self, names={**self.names, **mapping}, named=frozenset(mapping))

    def parse(self, text: str) -> dict[str, str]:
        """``"user=uid,time=ts" -> {"user": "uid", "time": "ts"}``; a ValueError names an unknown role.

        >>> from training.data.import_log import LOG_COLUMNS
        >>> LOG_COLUMNS.parse("user=uid, time=ts")
        {'user': 'uid', 'time': 'ts'}
        """
        out: dict[str, str] = {}
        for part in (p.strip() for p in text.split(",")):
            if not part:
                continue
            role, sep, name = part.partition("=")
            role, name = role.strip(), name.strip()
            if not sep or not name:
                raise ValueError(f"{self.flag}: expected ROLE=COLUMN, got {part!r}")
            self._check_role(role)
            out[role] = name
        return out

    def _check_role(self, role: str) -> None:
        if role not in self.names:
            raise ValueError(f"{self.flag}: unknown role {role!r} (roles: {', '.join(self.roles)})")

    def require(self, table: Table, *roles: str, optional: tuple[str, ...] = ()) -> list[str]:
        """Checks that ``table`` has the column of each of ``roles``, and of each ``optional`` role named on the
        command line (a UserError names the file, the role and ``FLAG ROLE=NAME``); returns the ``optional``
        roles whose column is present."""
        for role in (*roles, *(r for r in optional if r in self.named)):
            table.require(self[role], f"{self.labels.get(role, role)} column", f"{self.flag} {role}=NAME")
        return [role for role in optional if self[role] in table.columns]
