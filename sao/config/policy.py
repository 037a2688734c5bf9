"""The policy model, how it samples, and how its context is compressed."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from sao.config.section import Section, tagged_table


class FolderTransport(Section):
    type: Literal["folder"] = Field(
        "folder", description="folder: samplers read the trainer's policy folder (local disk, or a shared mount: "
                              "sampler.policy_dir).")


class KafkaTransport(Section):
    type: Literal["kafka"] = Field(
        "kafka", description="kafka: each file travels in chunks on topics.weights before its announcement, so a "
                             "sampler needs only the broker and the announcement key (sampler.announce_key_file).")
    chunk_bytes: int = Field(
        4 << 20, ge=64 << 10, le=32 << 20,
        description="Bytes of a file per chunk message, well under the broker's message limit (MAX_MESSAGE_BYTES in "
                    "sao/transport/kafka.py).")


Transport = Annotated[FolderTransport | KafkaTransport, Field(discriminator="type"), tagged_table("folder")]


class PolicyConfig(Section):
    moved_knobs: ClassVar = {"chunk_bytes": ("transport", "chunk_bytes", "kafka")}

    model: str = Field(
        "smollm2-135m-instruct",
        description="`smollm2-135m-instruct` (packaged, converted once to a cached safetensors folder), "
                    "`tiny` (random 2-layer Llama with the SmolLM2 tokenizer, for tests) or any HF model path.")
    system_prompt: str | None = Field(
        None, description="System message of every episode; unset = the env's own (e.g. arithmetic: 'You are a "
                          "calculator...').")
    temperature: float = Field(
        0.7, gt=0, description="Sampling temperature; the trainer recomputes log-probs under it. 0.7: a small policy at "
                               "1.0 succeeds less often on its sampled first tries, with the held-out gain the same "
                               "within error (measured: benchmarks/README.md).")
    top_p: float = Field(
        1.0, gt=0, le=1, description="Nucleus sampling: draw from the smallest set of tokens holding this much "
                                     "probability. Behaviour log-probs are those of that truncated distribution, so "
                                     "below 1 the importance ratio pi/mu is honestly < 1 even on-policy.")
    max_new_tokens: int | None = Field(None, ge=1,
                                       description="Tokens per action at most; unset = the env's own (arithmetic 24).")
    stop: list[str] | None = Field(
        None, description="Stop strings: an action ends with the token that completes one of them (it is kept); "
                          "unset = the env's own (usually none). End-of-turn tokens always stop.")
    seed: int = Field(0, description="Seed of the `tiny` test model's random weights (identical in samplers and trainer); "
                                     "a real model loads its weights, and the projector starts zero or aligned.")
    projector: str = Field(
        "auto", min_length=1,
        description="Memory projector at start: `auto` = the aligned weights shipped for this model + encoder pair "
                    "(`sao compression align`) if any, else zero; `zero` = zero init (memory adds nothing until "
                    "trained); or a projector .safetensors path, refused unless its sidecar names this model and encoder.")
    cache_dir: str = Field("~/.cache/sao/models", description="Where converted models are cached.")
    transport: Transport = Field(
        default_factory=FolderTransport,
        description="How published weights reach the samplers: folder or kafka, with that transport's own knobs. "
                    "The trainer writes its own files either way (sao eval, shadow scoring, checkpoints use them).")


# Earlier turns one step may recall as text: bounds compression.recall_turns, and readers check a trajectory
# against it before reading a step's list (sao/schema.py).
MAX_RECALL_TURNS = 16


class CompressionConfig(Section):
    encoder: str = Field("default",
                         description="sentence-transformers model path or name; `default` = packaged all-MiniLM-L6-v2.")
    temporal_weights: str | None = Field(None, description="LSTM redundancy filter weights; unset = the shipped default.")
    keep_threshold: float | None = Field(
        None, ge=0, le=2,
        description="Keep a turn whose prediction error (1 - cos) exceeds this; unset = the weights' calibrated value.")
    bottleneck: str = Field(
        "auto", min_length=1,
        description="How wide a memory slot travels: auto = INT8 coordinates in the basis shipped for the encoder "
                    "(full width where none ships), none = full width, or a basis file from `sao compression "
                    "bottleneck`.")
    recent_window: int = Field(
        1, ge=0, description="Latest finished turns given in full text rather than as memory. At >= 1 a retry sees "
                             "its last answer and the feedback as a well-formed chat; 0 leaves every earlier turn to "
                             "memory.")
    recall_turns: int = Field(
        1, ge=0, le=MAX_RECALL_TURNS,
        description="Earlier turns the memory puts back as text at each turn, those of the visible slots nearest the "
                    "current observation; 0 = memory reaches the policy as soft tokens only.")
