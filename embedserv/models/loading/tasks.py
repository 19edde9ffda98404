"""What a served model can do, read from its files: which tasks, and how Rerank and Classify finish scores.

- A *ForSequenceClassification checkpoint classifies; with one label it also reranks (a cross-encoder).
- A *ForTokenClassification checkpoint of a family that has its head labels tokens (ClassifyTokens), and only
  that; one of a family without it is refused.
- A causal LM is a yes/no reranker (Qwen3-Reranker) when `--decoder-reranker` says so, or, without the
  flag, when its path names a reranker (hub snapshots keep the repository name in the path);
  `--no-decoder-reranker` turns that detection off. A vision-language generator of VL_RERANKERS
  (Qwen3VLForConditionalGeneration: Qwen3-VL-Reranker) is one by the same rule, its prompt framed with images
  (engine/inputs/vl_rerank_rules.py); otherwise it embeds.
- A causal LM with an LM head generates. It also embeds (and reranks by cosine) when it comes as a
  sentence-transformers model (modules.json), as decoder embedders do.
- A seq2seq model (BART, mBART, T5, mT5 *ForConditionalGeneration) generates; it is a monoT5-style
  reranker instead (the `true` against `false` logit at the first decoder step) when `--decoder-reranker`
  says so or its path names `monot5` or a reranker. BartForSequenceClassification classifies, reading
  the decoder at the last token of the shifted input as transformers does.
- Any other model embeds, and reranks by cosine similarity of query and document embeddings.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from embedserv.errors import ConfigError
from embedserv.models.loading.family import Family
from embedserv.types import Activation, RerankMode, Task

logger = logging.getLogger(__name__)


# CrossEncoder activations by torch class name; sentence-transformers saves the dotted path.
_ACTIVATIONS = {"Sigmoid": Activation.SIGMOID, "Identity": Activation.IDENTITY, "Tanh": Activation.TANH}


@dataclass(frozen=True)
class YesNoTemplate:
    """A reranking prompt around query and document, scored by the "yes" against "no" logit."""

    prefix: str
    suffix: str
    default_instruction: str

    def query_part(self, instruction: str, query: str) -> str:
        """The text before the document; the document follows it directly."""
        return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: "


@dataclass(frozen=True)
class Seq2SeqYesNoTemplate:
    """A seq2seq reranker's encoder prompt, scored at the first decoder step by the `yes` token's logit
    against the `no` token's (monoT5: softmax over [false, true] -> true = sigmoid of the difference)."""

    before_query: str
    before_document: str
    after_document: str
    yes_token: str
    no_token: str
    # Seq2seq rerankers take no instruction.
    default_instruction: str = ""


# monoT5's prompt and tokens, as pygaggle and the model cards use them.
MONOT5 = Seq2SeqYesNoTemplate("Query: ", " Document: ", " Relevant:", yes_token="▁true", no_token="▁false")

SEQ2SEQ_GENERATORS = (
    "BartForConditionalGeneration",
    "MBartForConditionalGeneration",
    "T5ForConditionalGeneration",
    "MT5ForConditionalGeneration",
)


# The template of the Qwen3-Reranker model card.
QWEN3_RERANKER = YesNoTemplate(
    prefix=(
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
        'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    ),
    suffix="<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    default_instruction="Given a web search query, retrieve relevant passages that answer the query",
)


@dataclass(frozen=True)
class VlYesNoTemplate:
    """A vision-language yes/no reranker's prompt (Qwen3-VL-Reranker, its scripts/qwen3_vl_reranker.py): the system
    turn, then one user turn of the instruction, the query and the document, each side a text, an image or an
    image then a text; engine/inputs/vl_rerank_rules.py lays it out. Scored as YesNoTemplate's."""

    system: str
    default_instruction: str
    # (min, max) pixels per image: the bounds its script resizes images to (qwen_vl_utils) before the processor,
    # which then does not resize, in place of preprocessor_config.json's.
    pixels: tuple[int, int]


QWEN3_VL_RERANKER = VlYesNoTemplate(
    system=(
        "Judge whether the Document meets the requirements based on the Query and the Instruct provided. Note "
        'that the answer can only be "yes" or "no".'
    ),
    default_instruction="Given a search query, retrieve relevant candidates that answer the query.",
    # qwen3_vl_reranker.py's MIN_PIXELS and MAX_PIXELS: 4 and 1,280 merged 32 x 32 blocks.
    pixels=(4 * 32**2, 1280 * 32**2),
)
# Vision-language generators that are yes/no rerankers when detected as causal LMs are, and their prompts.
VL_RERANKERS = {"Qwen3VLForConditionalGeneration": QWEN3_VL_RERANKER}


@dataclass(frozen=True)
class TaskSpec:
    tasks: tuple[Task, ...]
    # How Rerank builds its inputs; None: the model does not rerank.
    rerank_mode: RerankMode | None = None
    # Label names in the model's order (classifiers).
    labels: tuple[str, ...] = ()
    # Classify applies a sigmoid per label instead of a softmax.
    multi_label: bool = False
    # sentence-transformers CrossEncoder's activation for rerank scores: sigmoid, identity or tanh.
    rerank_activation: Activation = Activation.SIGMOID
    template: YesNoTemplate | Seq2SeqYesNoTemplate | VlYesNoTemplate | None = None
    # Decoder classifiers score the last token that is not padding (transformers' rule): trailing
    # padding tokens are dropped before the model runs, which leaves earlier causal states unchanged.
    strip_trailing_pad_id: int | None = None
    # Encoder-decoder models: the decoder's first token, and what the decoder reads on the prefill-only
    # path: "start" (the start token alone: a yes/no reranker's first step) or "shifted" (the input shifted
    # right behind the start token: BART's classifier). None for other models.
    decoder_start_token_id: int | None = None
    prefill_decoder_input: str | None = None


def architecture_of(hf_config) -> str:
    return (getattr(hf_config, "architectures", None) or [""])[0]


def is_decoder_reranker(model_dir: Path, architecture: str, flag: bool | None) -> bool:
    """`--decoder-reranker` (True/False) decides for causal LMs and seq2seq generators; other models are
    never yes/no rerankers, so one flag can serve a list of models of which only some are such models.
    Without the flag a path naming a reranker (or monoT5, for seq2seq models) decides. VL_RERANKERS' architectures
    count as causal LMs here."""
    if architecture in SEQ2SEQ_GENERATORS:
        if flag is not None:
            return flag
        path = str(model_dir).lower()
        return "monot5" in path or "reranker" in path
    if not architecture.endswith("ForCausalLM") and architecture not in VL_RERANKERS:
        if flag:
            logger.warning("%s is %s, not a causal LM: --decoder-reranker does not apply", model_dir, architecture)
        return False
    if flag is not None:
        return flag
    return "reranker" in str(model_dir).lower()


def _activation_path(model_dir: Path, hf_config) -> str | None:
    """Where CrossEncoder reads it: its own config file, then config.json (v4-5), then the pre-v4 key."""
    st_config = model_dir / "config_sentence_transformers.json"
    if st_config.exists():
        path = json.loads(st_config.read_text()).get("activation_fn")
        if path:
            return path
    saved = getattr(hf_config, "sentence_transformers", None)
    if isinstance(saved, dict) and saved.get("activation_fn"):
        return saved["activation_fn"]
    return getattr(hf_config, "sbert_ce_default_activation_function", None)


def rerank_activation(model_dir: Path, hf_config, num_labels: int) -> Activation:
    default = Activation.SIGMOID if num_labels == 1 else Activation.IDENTITY
    path = _activation_path(model_dir, hf_config)
    if path is None:
        return default
    if not path.startswith("torch."):
        # CrossEncoder will not import a non-torch path without trust_remote_code; nor do we.
        logger.warning("%s: ignoring activation_fn %s (not a torch class); using %s", model_dir, path, default)
        return default
    name = path.rsplit(".", 1)[-1]
    if name not in _ACTIVATIONS:
        raise ConfigError(
            f"{model_dir}: CrossEncoder activation {path} is not supported; supported: {', '.join(_ACTIVATIONS)}"
        )
    return _ACTIVATIONS[name]


def read_task_spec(
    model_dir: Path,
    hf_config,
    family: Family,
    is_causal: bool,
    decoder_reranker: bool | None,
    has_lm_head: bool = False,
) -> TaskSpec:
    architecture = architecture_of(hf_config)
    if family.is_encoder_decoder:
        return _seq2seq_task_spec(model_dir, hf_config, family, decoder_reranker)
    if is_decoder_reranker(model_dir, architecture, decoder_reranker):
        template = VL_RERANKERS.get(architecture, QWEN3_RERANKER)
        return TaskSpec(tasks=(Task.RERANK,), rerank_mode=RerankMode.TEMPLATE, template=template)
    if architecture.endswith("ForCausalLM") and is_causal and has_lm_head:
        if (model_dir / "modules.json").exists():
            return TaskSpec(tasks=(Task.EMBED, Task.RERANK, Task.GENERATE), rerank_mode=RerankMode.EMBEDDINGS)
        return TaskSpec(tasks=(Task.GENERATE,))
    if architecture.endswith("ForTokenClassification"):
        if architecture not in family.token_classifiers:
            supported = ", ".join(family.token_classifiers) or "none"
            raise ConfigError(
                f"{model_dir}: {architecture} is not served (token classification heads of {family.name}: "
                f"{supported}); serve a supported architecture, or the base model to embed"
            )
        return TaskSpec(tasks=(Task.TOKEN_CLASSIFY,), labels=_labels(hf_config))
    classifier = family.classifiers.get(architecture)
    if classifier is None:
        return TaskSpec(tasks=(Task.EMBED, Task.RERANK), rerank_mode=RerankMode.EMBEDDINGS)
    labels = _labels(hf_config)
    # Decoder classifiers score the last token.
    is_decoder = classifier.token_for(hf_config) == "last"
    single = len(labels) == 1
    return TaskSpec(
        tasks=(Task.RERANK, Task.CLASSIFY) if single else (Task.CLASSIFY,),
        rerank_mode=RerankMode.PAIR if single else None,
        labels=labels,
        multi_label=getattr(hf_config, "problem_type", None) == "multi_label_classification",
        rerank_activation=rerank_activation(model_dir, hf_config, len(labels)),
        strip_trailing_pad_id=getattr(hf_config, "pad_token_id", None) if is_decoder and is_causal else None,
    )


def _seq2seq_task_spec(model_dir: Path, hf_config, family: Family, decoder_reranker: bool | None) -> TaskSpec:
    architecture = architecture_of(hf_config)
    start = getattr(hf_config, "decoder_start_token_id", None)
    if start is None:
        raise ConfigError(f"{model_dir}: an encoder-decoder config needs decoder_start_token_id")
    if architecture in family.classifiers:
        labels = _labels(hf_config)
        return TaskSpec(
            tasks=(Task.CLASSIFY,),
            labels=labels,
            multi_label=getattr(hf_config, "problem_type", None) == "multi_label_classification",
            decoder_start_token_id=start,
            prefill_decoder_input="shifted",
        )
    if architecture not in SEQ2SEQ_GENERATORS:
        raise ConfigError(
            f"{model_dir}: encoder-decoder architecture {architecture or '(none)'} is not supported; supported: "
            f"{', '.join(SEQ2SEQ_GENERATORS + tuple(family.classifiers))}"
        )
    if is_decoder_reranker(model_dir, architecture, decoder_reranker):
        return TaskSpec(
            tasks=(Task.RERANK,),
            rerank_mode=RerankMode.TEMPLATE,
            template=MONOT5,
            decoder_start_token_id=start,
            prefill_decoder_input="start",
        )
    return TaskSpec(tasks=(Task.GENERATE,), decoder_start_token_id=start)


def with_outputs(task: TaskSpec, output_tasks: tuple[Task, ...]) -> TaskSpec:
    """An embedder's tasks by what it outputs (models/loading/outputs.py): Embed with a dense vector,
    EmbedSparse and EmbedMultiVector; Rerank by cosine of dense vectors, or by MaxSim of token vectors."""
    if not output_tasks:
        return task
    if Task.EMBED in output_tasks:
        rerank = (Task.RERANK,), RerankMode.EMBEDDINGS
    elif Task.EMBED_MULTI_VECTOR in output_tasks:
        rerank = (Task.RERANK,), RerankMode.MAXSIM
    else:
        rerank = (), None
    others = tuple(t for t in task.tasks if t not in (Task.EMBED, Task.RERANK))
    return replace(task, tasks=output_tasks + rerank[0] + others, rerank_mode=rerank[1])


def _labels(hf_config) -> tuple[str, ...]:
    id2label = getattr(hf_config, "id2label", None) or {}
    return tuple(str(id2label[i]) for i in sorted(id2label, key=int))
