"""PopularityRecommender: the cold-start recommender implementing the engine protocol."""

from __future__ import annotations

import json
import math

import pytest

from recsvc.errors import UserError
from recsvc.recommender.api import RecQuery
from recsvc.service.startup.popularity import PopularityRecommender


def test_most_popular_first_ties_by_id_and_exclusions():
    rec = PopularityRecommender({5: 10, 3: 10, 9: 50, 1: 1})
    assert rec.popular_items(10) == [9, 3, 5, 1]
    assert rec.popular_items(2, exclude=[9]) == [3, 5]
    (result,) = rec.recommend([RecQuery(history=[1], k=3, exclude=(3,))])
    assert result.item_ids == [9, 5, 1]
    assert result.scores == pytest.approx([math.log(50 / 71), math.log(10 / 71), math.log(1 / 71)])
    assert result.stats.target_calls == 0
    assert rec.known_item(9) and not rec.known_item(2)


def test_batch_of_mixed_queries_and_small_catalog():
    rec = PopularityRecommender.from_histories([[1, 2, 2], [2, 3]])
    results = rec.recommend([RecQuery(history=[1], k=5), RecQuery(history=[2], k=1, mode="strict")])
    assert [r.item_ids for r in results] == [[2, 1, 3], [2]]


def test_from_json_and_errors(tmp_path):
    path = tmp_path / "pop.json"
    path.write_text(json.dumps({"7": 3, "8": 1}))
    assert PopularityRecommender.from_json(path).popular_items(5) == [7, 8]
    path.write_text("[1, 2]")
    with pytest.raises(UserError, match="expected a JSON object"):
        PopularityRecommender.from_json(path)
    path.write_text('{"x": 1}')
    with pytest.raises(UserError, match="integers"):
        PopularityRecommender.from_json(path)
    with pytest.raises(UserError, match="empty"):
        PopularityRecommender({})
    with pytest.raises(UserError, match="finite"):
        PopularityRecommender({1: float("nan")})
