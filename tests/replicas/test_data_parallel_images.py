"""Images on a fleet (`--data-parallel-size`): the front end, which holds no tower, sends a
prompt with images to a replica as it is (routed by its text, each image its marker), and
the replica encodes and lays them out. One replica on Ray (a tiny random Mistral 3 with its
Pixtral tower, fp32): the official `openai` client's image answers as transformers' whole
model on the same weights, twice (the second time from the replica's kept encoding)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import transformers
from ray_processes import module_cluster, ray_daemons, running  # noqa: F401 (the cluster fixture)

from iterserve.replicas import ray_cluster
from iterserve.replicas.data_parallel import DataParallelEngine
from iterserve.replicas.router import make_router
from server_fixtures import MODEL_NAME, RunningServer, engine_config, serving, wait_until
from tiny_vision import picture, save_tiny_mistral3, transformers_greedy

pytest.importorskip("ray")
pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # a Ray cluster, a real server

IMAGE = picture(11, 70, 50)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def mistral3_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_tiny_mistral3(tmp_path_factory.mktemp("mistral3"), tokenizer_dir)


@pytest.fixture(scope="module")
def fleet(cluster: None, mistral3_dir: Path) -> Iterator[RunningServer]:
    engine = DataParallelEngine.launch(
        engine_config(mistral3_dir),
        1,
        make_router("prefix-affinity", 16),
        ray_cluster.connect(None, 1),  # the module's cluster
        threads=1,
    )
    with serving(engine) as server:  # type: ignore[arg-type]
        assert wait_until(lambda: engine.is_ready, timeout=60), engine.replica_states()
        yield server


def test_an_image_crosses_to_a_replica_and_answers_as_transformers(
    fleet: RunningServer, mistral3_dir: Path
) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(mistral3_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    want = tokenizer.decode(
        transformers_greedy(mistral3_dir, text, [IMAGE], MAX_TOKENS), skip_special_tokens=True
    )
    buffer = io.BytesIO()
    IMAGE.save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "And this?"}]  # fmt: skip
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="unused", max_retries=0)
    for _ in range(2):
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": content}],  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS, temperature=0.0,
        )  # fmt: skip
        assert answer.choices[0].message.content == want
        assert answer.usage is not None and answer.usage.prompt_tokens > 12, "the image's tokens"
