"""Fixes for the sweep's speech model types (see :mod:`quirks`)."""

from __future__ import annotations

from .. import tiny
from .registry import batch_fix, config_fix


@config_fix("kyutai_speech_to_text")
def _mimi_upsamples_depthwise(config):
    """Mimi's released codec upsamples depthwise (``upsample_groups`` 512 == its ``hidden_size`` 512): the shrunk
    width needs as many groups. The audio ids are codebook ids, not text ids for the shrink to move below the text
    vocabulary: the audio BOS is the codebook's last id (2048), the pad the embedding's last row (69569 released)."""
    config.codec_config.upsample_groups = config.codec_config.hidden_size
    config.audio_bos_token_id = config.codebook_vocab_size - 1
    config.audio_pad_token_id = config.vocab_size + config.num_codebooks * config.codebook_vocab_size


@batch_fix("kyutai_speech_to_text", kind="audio codes")
def _kyutai_text_and_audio_code_streams(model, config, batch):
    """Kyutai STT reads one text token and one Mimi code per codebook per frame (``input_ids`` [B, T, 1 +
    codebooks], as its ``generate`` lays them out from the codec's ``encode`` of the audio: the audio BOS first),
    and predicts the text stream."""
    import torch

    text = tiny.token_sampler(config)(tiny.SEQ)
    generator = torch.Generator().manual_seed(2)
    codes = torch.randint(config.codebook_vocab_size - 1, (*text.shape, config.num_codebooks), generator=generator)
    codes[:, 0] = config.audio_bos_token_id
    return {"input_ids": torch.cat([text.unsqueeze(-1), codes], dim=-1), "labels": text.clone()}


@config_fix("moonshine_streaming")
def _moonshine_decoder_key_value_heads(config):
    """The decoder's attention reads ``num_key_value_heads``, which the decoder's default config does not declare
    (a loaded config.json supplies it); plain multi-head attention, as the encoder config's default (8 of 8)."""
    config.num_key_value_heads = config.num_attention_heads


@batch_fix("canary", "cohere_asr", kind="audio")
def _parakeet_frames_of_encoder_mels(model, config, batch):
    """The Parakeet encoder reads ``input_features`` [B, frames, mels] with the encoder config's mel bins (128
    released), as the Parakeet feature extractor gives them; the top config names no mel bins for the sweep."""
    import torch

    mels = config.encoder_config.num_mel_bins
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(tiny.BATCH, tiny.SOURCE, mels, generator=generator)
    return {"input_features": features, "labels": batch["labels"]}


@batch_fix("seamless_m4t", "seamless_m4t_v2", mapping="speech", kind="audio")
def _seamless_stacked_frames(model, config, batch):
    """The SeamlessM4T feature extractor stacks pairs of 80-bin frames (``stride`` 2): ``input_features``
    [B, frames / 2, 160], the speech encoder's ``feature_projection_input_dim``."""
    import torch

    generator = torch.Generator().manual_seed(1)
    shape = (tiny.BATCH, tiny.SOURCE // 2, config.feature_projection_input_dim)
    return {"input_features": torch.randn(*shape, generator=generator), "labels": batch["labels"]}


@config_fix("t5gemma")
def _t5gemma_cross_attends_the_encoder_width(config):
    """The decoder's cross-attention reads encoder states of ``cross_attention_hidden_size``, which the config
    copies from the encoder's width when it is built (2304 by default); the shrunk encoder's width is smaller."""
    config.decoder.cross_attention_hidden_size = config.encoder.hidden_size


@config_fix("nemo_speechlm")
def _nemotron_transcribe_layer_kinds_and_widths(config):
    """The released Nemotron-H text stack mixes Mamba (``linear_attention``), MoE and attention layers, and builds
    its masks from an attention layer's cache; its first three layers have none: keep one of each kind. The
    diarization head reads its encoder's states at ``audio_hidden_size`` (512, that encoder's released width)."""
    config.text_config.layers_block_type = ["linear_attention", "moe", "full_attention"]
    diarization = config.audio_config.diarization_config
    diarization.head_config.audio_hidden_size = diarization.audio_config.hidden_size


@batch_fix("voxtral_realtime", kind="audio")
def _voxtral_realtime_audio_under_every_token(model, config, batch):
    """Voxtral Realtime adds one audio frame's embedding to every text token: its processor gives the text with
    ``input_features`` [B, mels, tokens x ``audio_length_per_tok``] and ``num_delay_tokens``."""
    import torch

    text = tiny.token_sampler(config)(tiny.SEQ)
    frames = text.shape[1] * config.audio_length_per_tok
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(text.shape[0], config.audio_config.num_mel_bins, frames, generator=generator)
    delay = config.default_num_delay_tokens
    return {"input_ids": text, "input_features": features, "num_delay_tokens": delay, "labels": text.clone()}


@config_fix("dia")
def _dia_decoder_cross_attends_the_encoder_width(config):
    """The decoder's cross-attention reads encoder states of ``cross_hidden_size`` (1024, the released encoder's
    width); the shrunk encoder is narrower."""
    config.decoder_config.cross_hidden_size = config.encoder_config.hidden_size


@batch_fix("dia", kind="text + audio codes")
def _dia_text_and_delayed_audio_codes(model, config, batch):
    """Dia's encoder reads byte tokens of the text; its decoder reads DAC codes [B, frames, channels] laid out
    by the Dia processor for training (``output_labels``): BOS and EOS frames around the codes, each channel
    delayed by ``delay_pattern``, labels the next frame per channel ([B x channels, frames]) with BOS and PAD
    ignored."""
    import torch
    from transformers.models.dia.processing_dia import DiaProcessor

    decoder = config.decoder_config
    bos, eos, pad = decoder.bos_token_id, decoder.eos_token_id, decoder.pad_token_id
    channels, delays = decoder.num_channels, config.delay_pattern
    generator = torch.Generator().manual_seed(1)
    text = torch.randint(1, config.encoder_config.vocab_size, (tiny.BATCH, tiny.SEQ), generator=generator)
    frames = tiny.TARGET - 2 - max(delays)  # the processor's sequence: BOS, codes, EOS, then the delay
    codes = torch.randint(min(bos, eos, pad), (tiny.BATCH, frames, channels), generator=generator)
    codes = torch.cat([torch.full_like(codes[:, :1], bos), codes, torch.full_like(codes[:, :1], eos)], dim=1)
    length = codes.shape[1] + max(delays)
    audio = torch.full((tiny.BATCH, length, channels), pad)
    audio[:, : codes.shape[1]] = codes
    indices = DiaProcessor.build_indices(tiny.BATCH, length, channels, delays, revert=False)
    delayed = DiaProcessor.apply_audio_delay(audio, pad, bos, indices)
    labels = delayed[:, 1:].clone()
    labels[(labels == pad) | (labels == bos)] = -100
    labels = labels.transpose(1, 2).reshape(tiny.BATCH * channels, -1).contiguous()
    return {"input_ids": text, "decoder_input_ids": delayed[:, :-1], "labels": labels}


@batch_fix("pop2piano", kind="audio")
def _pop2piano_mel_frames_of_model_width(model, config, batch):
    """Pop2Piano's encoder takes the log-mel frames as its embeddings: ``input_features`` [B, frames, mels], the
    feature extractor's mel bins equal to ``d_model`` (512 both, released); its ``input_ids`` are not audio."""
    import torch

    generator = torch.Generator().manual_seed(1)
    features = torch.randn(tiny.BATCH, tiny.SOURCE, config.d_model, generator=generator)
    return {"input_features": features, "labels": batch["labels"]}


@batch_fix("nemo_speechlm", kind="audio")
def _nemotron_transcribe_audio_in_the_prompt(model, config, batch):
    """Nemotron 3.5 Transcribe reads ``input_features`` [B, frames, mels] (frames a multiple of the encoder's
    ``subsampling_factor``) with their ``input_features_mask``, and one ``audio_token_id`` placeholder in the text
    per encoder frame, as its processor builds them."""
    import torch

    audio = config.audio_config
    frames = tiny.SOURCE - tiny.SOURCE % audio.subsampling_factor
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(tiny.BATCH, frames, audio.asr_config.num_mel_bins, generator=generator)
    mask = torch.ones(features.shape[:2], dtype=torch.long)
    with torch.no_grad():
        count = model.model.get_audio_features(features, mask).pooler_output.shape[0] // tiny.BATCH
    text = tiny.token_sampler(config)(tiny.SEQ)
    placeholders = torch.full((tiny.BATCH, count), config.audio_token_id, dtype=text.dtype)
    input_ids = torch.cat([text[:, :2], placeholders, text[:, 2:]], dim=1)
    labels = input_ids.masked_fill(input_ids == config.audio_token_id, -100)
    return {"input_ids": input_ids, "input_features": features, "input_features_mask": mask, "labels": labels}


@config_fix("qwen3_asr")
def _audio_tower_writes_the_texts_width(config):
    """The audio tower's projection ends at the text model's width (``output_dim`` = 3584 = the released text
    hidden size); the shrink cut the text model only."""
    config.audio_config.output_dim = config.text_config.hidden_size
