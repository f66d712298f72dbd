"""The catalog's semantic ids as a prefix trie of tensors, built once.

Nodes live in one id space: the root is 0, then the nodes of depth 1, 2, ..., L-1 (internal nodes), then the
leaves (depth L, one per distinct full id). ``children[node, code]`` is the child reached by ``code`` or -1.

Worked example (L = 2, codebook 4) for the ids ``{item 7: (1, 2), item 8: (1, 3), item 9: (2, 0)}``::

    node 0 (root)   children[0] = [-1, 1, 2, -1]      # codes 1 and 2 start some id
    node 1 = (1,)   children[1] = [-1, -1, 3, 4]
    node 2 = (2,)   children[2] = [5, -1, -1, -1]
    leaves 3 = (1,2) -> item 7, 4 = (1,3) -> item 8, 5 = (2,0) -> item 9

Lookups are pure functions of the node (the prefix), so beam search never rolls matcher state back.
Exclusions are a per-request boolean row over nodes (``dead``): a node is dead when every item under it is
excluded, so beam search never enters a prefix that can only end in excluded items.
Colliding ids (the shared reference ids have some) are accepted: a leaf then stands for several items and
resolves to the lowest item id that is not excluded.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from recsvc_base.errors import UserError
from tokenizer_rqvae.ids import SemanticIds

FILL_ROWS = 64  # rows of a large table written per call (about 0.5 ms each for a 256-code table)


def _filled(shape: tuple[int, int], value: int) -> np.ndarray:
    """``np.full(shape, value)`` (int64) written ``FILL_ROWS`` rows per call: a bundle loaded beside a serving one
    (recsvc's bundle swap) yields the cores between calls, where one call would hold one for 100-200 ms."""
    out = np.empty(shape, dtype=np.int64)
    for start in range(0, shape[0], FILL_ROWS):
        out[start : start + FILL_ROWS].fill(value)
    return out


class CatalogTrie:
    def __init__(self, ids: SemanticIds) -> None:
        codes = np.asarray(ids.codes, dtype=np.int64)  # [n, L]
        if len(codes) == 0:
            raise UserError("cannot build a trie of an empty catalog")
        n, levels = codes.shape
        self.levels = levels
        self.codebook_size = ids.codebook_size
        self.ids = ids
        # Number the distinct prefixes of each depth; node_of_depth[d][i] = node id of item i's depth-d prefix.
        node_of_depth = [np.zeros(n, dtype=np.int64)]
        next_id = 1
        for d in range(1, levels + 1):
            _, inverse = np.unique(codes[:, :d], axis=0, return_inverse=True)
            inverse = inverse.reshape(-1)
            node_of_depth.append(inverse + next_id)
            next_id += int(inverse.max()) + 1
        self.num_nodes = next_id
        self.num_internal = int(node_of_depth[levels].min())  # leaves are numbered last
        children = _filled((self.num_internal, self.codebook_size), -1)  # 46 MB for Beauty's 12k items
        depth = np.zeros(self.num_nodes, dtype=np.int64)
        count = np.zeros(self.num_nodes, dtype=np.int64)
        count[0] = n
        for d in range(1, levels + 1):
            parent, child = node_of_depth[d - 1], node_of_depth[d]
            children[parent, codes[:, d - 1]] = child
            depth[child] = d
            np.add.at(count, child, 1)
        path = np.stack(node_of_depth, axis=1)  # [n, L+1] root .. leaf
        parent = np.full(self.num_nodes, -1, dtype=np.int64)
        node_code = np.full(self.num_nodes, -1, dtype=np.int64)
        ancestors = np.full((self.num_nodes, levels), -1, dtype=np.int64)
        for d in range(1, levels + 1):
            parent[path[:, d]] = path[:, d - 1]
            node_code[path[:, d]] = codes[:, d - 1]
            ancestors[path[:, d], :d] = path[:, 1 : d + 1]
        # leaf -> representative item (lowest item id); item_ids are ascending so the first row wins
        leaf_item = np.full(self.num_nodes - self.num_internal, -1, dtype=np.int64)
        leaf_rows = path[:, levels] - self.num_internal
        for row in range(n - 1, -1, -1):
            leaf_item[leaf_rows[row]] = ids.item_ids[row]
        self.children = torch.from_numpy(children)  # [num_internal, C] child node or -1
        self.depth = torch.from_numpy(depth)  # [num_nodes]
        self.count = torch.from_numpy(count)  # [num_nodes] items under each node
        self.item_path = torch.from_numpy(path)  # [n, L+1] node ids root..leaf per item row
        self.leaf_item = torch.from_numpy(leaf_item)  # [num_leaves] representative item id
        self.parent = torch.from_numpy(parent)  # [num_nodes] parent node (-1 for the root)
        self.node_code = torch.from_numpy(node_code)  # [num_nodes] code of the node's last token (-1 root)
        self.ancestors = torch.from_numpy(ancestors)  # [num_nodes, L] path nodes depth 1..depth(node), then -1
        self._collided = bool(len(np.unique(leaf_rows)) != n)
        # host copies for reading a request's leaves out (``items_of_leaves``): no device tensor is touched
        self._leaf_item_host = leaf_item
        self._path_host, self._count_host = path, count  # ``dead_nodes`` counts on the host, then one copy
        self._edge_host = (parent, node_code, depth)  # ``dead_edges``: a node's parent, code and depth
        self._leaf_group: dict[int, list[int]] = {}  # collided leaf -> its item ids, ascending
        if self._collided:
            for row in range(n):
                self._leaf_group.setdefault(int(path[row, levels]), []).append(int(ids.item_ids[row]))
        self._on: dict[str, CatalogTrie] = {}  # device -> this trie's copy there (``to``)

    _TENSORS = ("children", "depth", "count", "item_path", "leaf_item", "parent", "node_code", "ancestors")

    @property
    def device(self) -> torch.device:
        return self.children.device

    def to(self, device: torch.device | str) -> CatalogTrie:
        """This trie with its tensors on ``device``: ``self`` when they are there already, else a copy made once
        per device and kept (the engine moves the trie to its model's device once, never per step)."""
        device = torch.device(device)
        if device.type == self.device.type and (device.index is None or device == self.device):
            return self
        key = str(device)
        if key not in self._on:
            copy = object.__new__(CatalogTrie)
            copy.__dict__.update(self.__dict__)
            for name in self._TENSORS:
                setattr(copy, name, getattr(self, name).to(device))
            copy._on = {}
            self._on[key] = copy
        return self._on[key]

    # ---- batched lookups (beam search) -------------------------------------------------------------------
    def allowed(
        self, nodes: torch.Tensor, dead: torch.Tensor | None = None, rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes allowed after each prefix node.

        nodes: [M] node ids (-1 for a dead beam and leaves: nothing allowed); dead: [B, num_nodes] bool (per
        request) or None; rows: [M] request row of each node (required with ``dead``).
        Returns (mask [M, C] bool, child [M, C] node ids, -1 where absent).
        """
        internal = (nodes >= 0) & (nodes < self.num_internal)  # leaves and -1 have no children
        child = self.children.index_select(0, torch.where(internal, nodes, 0))  # [M, C]
        child = torch.where(internal[:, None], child, -1)
        mask = child >= 0
        if dead is not None:
            assert rows is not None and rows.shape == nodes.shape
            mask &= ~dead[rows[:, None], child.clamp(min=0)]
        return mask, child

    def dead_nodes(self, excluded: Sequence[Sequence[int]]) -> torch.Tensor:
        """Per request, nodes all of whose items are excluded: [B, num_nodes] bool. Unknown ids are ignored.

        Example: excluding items 7 and 8 above kills leaves 3, 4 and node 1 (both its items are gone).
        """
        hits = np.zeros((len(excluded), self.num_nodes), dtype=np.int64)  # on the host: no device op per row
        for b, items in enumerate(excluded):
            rows = [self.ids.index_of(i) for i in set(int(x) for x in items) if i in self.ids]
            if rows:
                np.add.at(hits[b], self._path_host[rows].reshape(-1), 1)  # [r * (L+1)] nodes on their paths
        return torch.from_numpy(hits >= self._count_host).to(self.device)  # one host-to-device copy

    def dead_of(self, items: Sequence[int]) -> np.ndarray:
        """One request's dead nodes, sparse: [D] int64 node ids, ascending, the True columns of its
        ``dead_nodes`` row (the excluded items' leaves and every ancestor they empty; the root when all are
        excluded), counted over the items' paths only. Unknown ids are ignored."""
        rows = [self.ids.index_of(i) for i in set(int(x) for x in items) if i in self.ids]
        if not rows:
            return np.zeros(0, dtype=np.int64)
        nodes, hits = np.unique(self._path_host[rows], return_counts=True)  # [u] nodes on the paths, items under
        return nodes[hits >= self._count_host[nodes]]

    def dead_edges(self, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[D] non-root node ids -> ([D] parents, [D] codes, [D] depths) on the host: the (beam node, code) step
        that reaches each node, what a search blocks to keep out of it, and the step's depth."""
        parent, code, depth = self._edge_host
        return parent[nodes], code[nodes], depth[nodes]

    def leaf_items(self, leaves: torch.Tensor, excluded: Sequence[int] = ()) -> list[int]:
        """Item id of each leaf node (collided leaves: the lowest item id not excluded): one host read."""
        return self.items_of_leaves(leaves.reshape(-1).tolist(), excluded)

    def items_of_leaves(self, leaves: Sequence[int], excluded: Sequence[int] = ()) -> list[int]:
        """``leaf_items`` of leaves already read to the host (Python ints): reads no tensor."""
        first = self._leaf_item_host
        if not self._collided:
            return [int(first[leaf - self.num_internal]) for leaf in leaves]
        ex = set(int(x) for x in excluded)
        out = []
        for leaf in leaves:
            items = [i for i in self._leaf_group.get(int(leaf), ()) if i not in ex]
            out.append(min(items) if items else int(first[leaf - self.num_internal]))
        return out

    def codes_of_nodes(self, nodes: torch.Tensor) -> torch.Tensor:
        """[...] node ids -> [..., L] codes of their prefixes (-1 beyond the node's depth / for node -1)."""
        anc = self.ancestors[nodes.clamp(min=0)]  # [..., L]
        codes = torch.where(anc >= 0, self.node_code[anc.clamp(min=0)], torch.full_like(anc, -1))
        return torch.where(nodes[..., None] >= 0, codes, torch.full_like(codes, -1))

    # ---- scalar helpers (tests, transformers' prefix_allowed_tokens_fn) ----------------------------------
    def node_of_prefix(self, prefix: Sequence[int]) -> int:
        """Node reached by a code prefix, or -1 if no catalog id starts with it."""
        node = 0
        for code in prefix:
            if node >= self.num_internal or not 0 <= code < self.codebook_size:
                return -1
            node = int(self.children[node, code])
            if node < 0:
                return -1
        return node

    def allowed_codes(self, prefix: Sequence[int], dead_row: torch.Tensor | None = None) -> list[int]:
        """Codes that may follow ``prefix`` (a pure function of the prefix)."""
        node = self.node_of_prefix(prefix)
        if node < 0 or node >= self.num_internal:
            return []
        child = self.children[node]
        ok = child >= 0
        if dead_row is not None:
            ok &= ~dead_row[child.clamp(min=0)]
        return torch.nonzero(ok).reshape(-1).tolist()

    def enumerate_ids(self, dead_row: torch.Tensor | None = None) -> set[tuple[int, ...]]:
        """Every full id the trie accepts (depth-first over the tensors)."""
        out: set[tuple[int, ...]] = set()
        stack: list[tuple[int, tuple[int, ...]]] = [(0, ())]
        while stack:
            node, prefix = stack.pop()
            if len(prefix) == self.levels:
                out.add(prefix)
                continue
            for code in self.allowed_codes(prefix, dead_row):
                stack.append((int(self.children[node, code]), prefix + (code,)))
        return out
