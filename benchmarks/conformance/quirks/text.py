"""Fixes for the sweep's text model types (see :mod:`quirks`)."""

from __future__ import annotations

from .. import tiny
from .registry import base_config, batch_fix, config_fix


@config_fix("cohere_compass_text")
def _rope_parameters_per_layer_type(config):
    """The model reads its rope parameters per layer type (``rope_parameters["full_attention"]``); the released
    config (North-Micro-Vision) has them, the default config leaves the dict empty. The M-RoPE sections keep the
    default's 24:20:20 proportions over the tiny head's half (8)."""
    half = config.head_dim // 2
    section = [size * half // 64 for size in (24, 20, 20)]
    section[0] += half - sum(section)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    config.rope_parameters = {layer_type: dict(rope) for layer_type in dict.fromkeys(config.layer_types)}


@config_fix("musicgen", "musicgen_melody", mapping="causal")
def _causal_lm_reads_the_decoder_config(config):
    """The causal LM is MusicGen's decoder alone: loaded from a released checkpoint it gets the ``decoder``
    sub-config (its ``base_config_key``), while the auto mapping hands it the composite config, which has none of
    the decoder's keys. Give the composite the decoder's values; the decoder's start and pad token is its
    ``vocab_size`` (the embedding holds one extra row), as in facebook/musicgen-small."""
    decoder = config.decoder
    decoder.pad_token_id = decoder.bos_token_id = decoder.vocab_size
    for key, value in vars(decoder).items():
        setattr(config, key, value)


@batch_fix("musicgen", "musicgen_melody", mapping="causal", kind="audio codes")
def _one_token_stream_per_codebook(model, config, batch):
    """The decoder predicts every codebook of the audio codec at once: labels are ``[batch, seq, num_codebooks]``
    codes (what the codec's encoder gives), shifted right into the ``[batch * num_codebooks, seq]`` inputs."""
    import torch

    ids = tiny.token_sampler(config)
    codes = torch.stack([ids(tiny.SEQ) for _ in range(config.num_codebooks)], dim=-1)
    return {"labels": codes}


@config_fix("gemma3n_text")
def _kv_sharing_layers_follow_a_producer_of_each_type(config):
    """Gemma-3n's last ``num_kv_shared_layers`` reuse the keys and values of the last earlier layer of their type,
    so the unshared layers must hold every type (E2B: 30 layers, four sliding then one full, the last 10 shared).
    At three layers: sliding, full, then one shared sliding layer. The per-layer lists the shrink leaves at full
    width (the MLP sizes, the per-layer embedding's vocabulary and width) are cut to the sweep's widths."""
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"][: config.num_hidden_layers]
    config.num_kv_shared_layers = 1
    config.intermediate_size = [128] * config.num_hidden_layers
    config.vocab_size_per_layer_input = config.vocab_size
    config.hidden_size_per_layer_input = 16


@config_fix("zamba")
def _shared_attention_block_serves_several_layers(config):
    """Zamba's one attention block is shared by every hybrid layer (Zamba-7B: every sixth of 76), and the model ties
    the later uses to the first, so it needs two hybrid layers at least. The sizes the config derives from the width
    at construction (attention twice the width, the dt rank a sixteenth) are derived again from the tiny width."""
    config.layers_block_type = ["linear_attention", "hybrid", "hybrid"][: config.num_hidden_layers]
    config.attention_hidden_size = 2 * config.hidden_size
    config.attention_head_dim = config.attention_hidden_size // config.num_attention_heads
    config.mamba_dt_rank = -(-config.hidden_size // 16)


@config_fix("reformer")
def _reformer_decoder_with_axial_positions_over_the_batch(config):
    """The LM head needs a causal (``is_decoder``) Reformer, as in google/reformer-crime-and-punishment. In training
    its axial position shape must multiply to the sequence length and the chunk lengths divide it; the axial
    embedding widths sum to the hidden width (released: 64 + 192 of 256)."""

    config.is_decoder = True
    config.axial_pos_shape = [6, tiny.SEQ // 6]
    config.axial_pos_embds_dim = [config.hidden_size // 4, config.hidden_size * 3 // 4]
    config.local_attn_chunk_length = config.lsh_attn_chunk_length = 16
    config.attention_head_size = config.hidden_size // config.num_attention_heads
    config.max_position_embeddings = tiny.SEQ


@config_fix("xmod")
def _language_adapter_chosen(config):
    """X-MOD routes every layer through one language adapter: a user names it (``set_default_language("en_XX")``,
    the model card's call) or passes ``lang_ids``. Name the config's first language, what that call sets."""
    config.default_language = config.languages[0]


@config_fix("marian")
def _decoder_vocabulary_is_the_shared_one(config):
    """Marian's released models share one vocabulary between encoder and decoder (``decoder_vocab_size`` equals
    ``vocab_size``, and decoding starts from the pad token: Helsinki-NLP/opus-mt-en-de, 58101 and 58100); the
    shrink cuts ``vocab_size`` only, and moves the two ids apart."""
    config.decoder_vocab_size = config.vocab_size
    config.decoder_start_token_id = config.pad_token_id


@batch_fix("git", mapping="causal", kind="image")
def _caption_follows_the_image(model, config, batch):
    """GIT is a captioner: its text stack always reads the image's patch tokens first, and its loss skips them (it
    slices ``image_patch_tokens`` positions off the logits), so a batch without ``pixel_values`` has no text logits
    left. One image per caption, at the vision config's size (the processor's 224 pixels: 14x14 patches)."""
    import torch

    vision = config.vision_config
    generator = torch.Generator().manual_seed(2)
    size = (len(batch["input_ids"]), vision.num_channels, vision.image_size, vision.image_size)
    return {**batch, "pixel_values": torch.randn(size, generator=generator)}


@config_fix("dots3_note", "dots3_note_text")
def _attention_sizes_per_layer_type(config):
    """Dots-3's sliding layers carry their own attention sizes (``per_layer_config``: half the heads, twice the KV
    latent, a 256-wide head of 192 + 64), and the shrink cannot reach what a layer overrides (the global value is
    unreadable there), so heads and latents stay released-size and the rope fractions stale. Rebuild the tiny
    model the released way: the indexed layers' sizes globally, the sliding layers' as overrides, the rotary part
    of each head a quarter of it (64 of 256)."""
    text = config.get_text_config()
    text.per_layer_config = None
    sizes = {"num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32}
    sizes |= {"head_dim": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
    sizes |= {"index_head_dim": 16, "index_n_heads": 4, "index_topk": 32, "shared_experts_intermediate_size": 64}
    for key, value in sizes.items():
        setattr(text, key, value)
    sliding = {"num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 64, "qk_nope_head_dim": 24}
    types = text.layer_types
    text.per_layer_config = {i: dict(sliding) for i, kind in enumerate(types) if kind == "sliding_attention"}
    for kind in set(types):
        text.rope_parameters[kind]["partial_rotary_factor"] = 8 / 32


@config_fix("zamba2")
def _sizes_derived_from_the_width_again(config):
    """Zamba2 derives its SSM head size and its attention sizes from the width when built (Zamba2-2.7B: mamba heads
    of 2 x 2560 / 8, attention twice the width); the shrink changes the width after that, so derive them again.
    The shared attention block serves every hybrid layer (every sixth released): two of the three here."""
    config.layers_block_type = ["linear_attention", "hybrid", "hybrid"][: config.num_hidden_layers]
    config.hybrid_layer_ids = [i for i, kind in enumerate(config.layers_block_type) if kind == "hybrid"]
    config.attention_hidden_size = 2 * config.hidden_size
    config.attention_head_dim = 2 * config.hidden_size // config.num_attention_heads
    config.mamba_headdim = config.mamba_expand * config.hidden_size // config.n_mamba_heads
    config.kv_channels = config.hidden_size // config.num_attention_heads
    config.num_query_groups = config.num_attention_heads


@config_fix("xlstm")
def _block_width_and_count_follow_the_model_sizes(config):
    """xLSTM keeps its embedding width and block count twice, under the xLSTM names (``embedding_dim``,
    ``num_blocks``) and the transformers ones, equal in every released config (NX-AI/xLSTM-7b); the model reads
    both. The shrink cuts the transformers names only."""
    config.embedding_dim = config.hidden_size
    config.num_blocks = config.num_hidden_layers


@config_fix("blt")
def _sizes_between_the_byte_and_patch_stacks_derived_again(config):
    """BLT derives at construction whether the byte encoder's ``cross_attn_k`` outputs per patch need projecting to
    the global transformer's width (``encoder_cross_output_size``: BLT-7B's do, BLT-1B's match), and its local
    decoder reads the global width (``hidden_size_global``); the shrink changes the widths after that. Derive
    both again. The hash n-gram embeddings (six tables of 500002 rows released) get the sweep's vocabulary."""

    encoder, decoder, global_ = config.encoder_config, config.decoder_config, config.global_config
    cross = encoder.hidden_size * config.cross_attn_k
    global_.encoder_cross_output_size = cross if cross != global_.hidden_size else None
    encoder.hidden_size_global = decoder.hidden_size_global = global_.hidden_size
    config.encoder_hash_byte_group_vocab = tiny.VOCAB


base_config(
    "gemma4_assistant",
    text_config={
        "model_type": "gemma4_text",
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "enable_moe_block": False,
        "use_double_wide_mlp": False,
    },
)  # its default text config is Gemma-4 E2B's, whose per-layer inputs, MoE and wide MLP a drafter has none of


@config_fix("gemma4_assistant", "gemma4_unified_assistant")
def _drafter_reuses_every_layer_kv(config):
    """The assistant is a drafter whose every layer reuses the target model's keys and values
    (``num_kv_shared_layers`` = all layers: its config sets that only when unset, so the released count stays
    after the shrink). It reads one sliding and one full-attention KV state, so its layers hold both types (the
    released five sliding to one full, the last full; the full layers' heads twice as wide: 512 of 256), and its
    input is the target's width (``backbone_hidden_size``), here the sweep's."""
    text = config.text_config
    text.per_layer_config = None
    text.layer_types = ["sliding_attention"] * (text.num_hidden_layers - 1) + ["full_attention"]
    text.per_layer_config = {text.num_hidden_layers - 1: {"head_dim": 2 * text.head_dim}}
    text.num_kv_shared_layers = text.num_hidden_layers
    config.backbone_hidden_size = text.hidden_size


@batch_fix("gemma4_assistant", "gemma4_unified_assistant", mapping="causal", kind="target states")
def _target_states_to_draft_from(model, config, batch):
    """The drafter takes what the target model hands it when drafting: its last hidden states joined to the token
    embeddings (``inputs_embeds``, twice the target's width) and the keys and values of the target's last
    sliding and full-attention layers (``shared_kv_states``); random here, at the batch's length."""
    import torch

    text = config.text_config
    generator = torch.Generator().manual_seed(2)
    size = batch["input_ids"].shape
    embeds = torch.randn(*size, 2 * config.backbone_hidden_size, generator=generator)
    states = {}
    for kind in dict.fromkeys(text.layer_types):
        head = text.per_layer_config[kind].head_dim
        kv = (size[0], text.num_key_value_heads, size[1], head)
        states[kind] = (torch.randn(kv, generator=generator), torch.randn(kv, generator=generator))
    return {"inputs_embeds": embeds, "shared_kv_states": states}


@batch_fix("evolla", kind="protein+text")
def _protein_sequences_beside_the_text(model, config, batch):
    """Evolla answers questions about a protein: its processor gives the SaProt encoder the protein's structure-aware
    tokens (``protein_input_ids``, amino acid and Foldseek letter pairs, with their mask) beside the text, and the
    text's decoder attends to what the encoder made of them. The sequence is shorter than the text, as a short
    protein's would be at these sizes."""

    protein = tiny.token_sampler(config.protein_encoder_config)(tiny.SEQ - 8)
    return {**batch, "protein_input_ids": protein, "protein_attention_mask": protein.new_ones(protein.shape)}
