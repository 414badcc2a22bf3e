//! Loading a GGUF file's own tensors: files written by `testing::write_gguf` from random weights load back
//! byte for byte (quantised blocks as they are; a `llama` file's interleaved `attn_q`/`attn_k` rows put back
//! in halves) and give the same logits; other formats are converted; what cannot be read is a clear error.

use pipeshard_core::dtype::DType;
use pipeshard_core::gguf::read_header;
use pipeshard_core::plan::Placement;
use pipeshard_core::workload::Workload;
use pipeshard_exec::testing::{
    manual_plan, random_tokens, tiny_k_spec, tiny_qwen3_moe_spec, tiny_qwen3_spec, tiny_spec, write_gguf,
};
use pipeshard_exec::weights::ModelWeights;
use pipeshard_exec::{ExecError, RunOptions, run};

fn temp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("pipeshard-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

fn logits(w: &ModelWeights) -> Vec<f32> {
    let spec = &w.spec;
    let plan = manual_plan(spec, Workload::single(9, 32, 3, 4), 1 << 30, 0, 0, 2, |_, _| Placement::Cpu);
    let opts = RunOptions {
        prompt: random_tokens(9, w.dims.vocab, 5),
        other_prompts: Vec::new(),
        gen_tokens: 3,
        force_tokens: Some(random_tokens(3, w.dims.vocab, 6)),
        keep_logits: true,
        ..RunOptions::default()
    };
    run(w, &plan, None, &opts).unwrap().logits.into_iter().flatten().collect()
}

#[test]
fn a_gguf_loads_back_byte_for_byte_and_gives_the_same_logits() {
    let cases = [
        (tiny_spec().with_uniform_weights(DType::Q4_0), "llama"),
        (tiny_spec().with_uniform_weights(DType::Bf16), "llama"),
        (tiny_qwen3_spec().with_uniform_weights(DType::Q8_0), "qwen3"),
        (tiny_qwen3_moe_spec().with_uniform_weights(DType::Q4_0), "qwen3moe"),
        (tiny_k_spec().with_uniform_weights(DType::Q4K), "llama"),
        (tiny_k_spec().with_uniform_weights(DType::Q6K), "llama"),
        (tiny_k_spec().with_uniform_weights(DType::Q2K), "llama"),
        (tiny_k_spec().with_uniform_weights(DType::Q3K), "llama"),
    ];
    for (spec, arch) in cases {
        let w = ModelWeights::random(&spec, 31).unwrap();
        let path = temp(&format!("{}-{arch}.gguf", spec.name));
        write_gguf(&w, arch, &path).unwrap();
        let (back, converted) = ModelWeights::from_gguf(&spec, &read_header(&path).unwrap()).unwrap();
        assert!(converted.is_empty(), "{}: {converted:?}", spec.name);
        for (a, b) in w.units().iter().zip(back.units()) {
            assert_eq!(a.id, b.id);
            assert!(a.buf.as_slice() == b.buf.as_slice(), "{} {arch}: unit {} differs", spec.name, a.id);
        }
        assert_eq!(logits(&w), logits(&back), "{}", spec.name);
    }
    // Without the row order put back, a llama file's attention would differ: the permutation is not a no-op.
    let spec = tiny_spec().with_uniform_weights(DType::Q4_0);
    let w = ModelWeights::random(&spec, 31).unwrap();
    let path = temp("as-qwen3.gguf");
    write_gguf(&w, "llama", &path).unwrap();
    let mut header = read_header(&path).unwrap();
    header.metadata.retain(|(k, _)| k != "general.architecture");
    let (raw_order, _) = ModelWeights::from_gguf(&spec, &header).unwrap();
    assert!(w.units().iter().zip(raw_order.units()).any(|(a, b)| a.buf.as_slice() != b.buf.as_slice()));
}

#[test]
fn other_formats_are_converted_and_unknown_tensors_named() {
    // bf16 weights written as bf16 load into an f16 spec: every matrix converted (and noted), norms f32 as is.
    let spec = tiny_qwen3_spec().with_uniform_weights(DType::Bf16);
    let w = ModelWeights::random(&spec, 8).unwrap();
    let path = temp("bf16.gguf");
    write_gguf(&w, "qwen3", &path).unwrap();
    let header = read_header(&path).unwrap();
    let f16 = tiny_qwen3_spec().with_uniform_weights(DType::F16);
    let (back, converted) = ModelWeights::from_gguf(&f16, &header).unwrap();
    assert!(!converted.is_empty() && converted.iter().all(|c| c.ends_with("bf16 → f16")), "{converted:?}");
    assert!(!converted.iter().any(|c| c.contains("norm")), "norms stay f32: {converted:?}");
    let want = ModelWeights::random(&spec, 8).unwrap();
    let (a, b) = (logits(&want), logits(&back));
    let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let top = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    assert!(err < 2e-2 * top, "f16 rounding of bf16 values only: {err} of {top}");
    // A q4_0 file read into a q8_0 spec: dequantised exactly, requantised.
    let q4 = tiny_qwen3_spec().with_uniform_weights(DType::Q4_0);
    let path = temp("q4.gguf");
    write_gguf(&ModelWeights::random(&q4, 8).unwrap(), "qwen3", &path).unwrap();
    let (_, converted) = ModelWeights::from_gguf(
        &tiny_qwen3_spec().with_uniform_weights(DType::Q8_0),
        &read_header(&path).unwrap(),
    )
    .unwrap();
    assert!(converted.iter().all(|c| c.ends_with("q4_0 → q8_0")) && !converted.is_empty());
    // A q3_k file read into a q4_k spec, and a q2_k one into q6_k: dequantised as ggml does, requantised.
    for (from, to) in [(DType::Q3K, DType::Q4K), (DType::Q2K, DType::Q6K)] {
        let path = temp(&format!("{from}.gguf"));
        write_gguf(
            &ModelWeights::random(&tiny_k_spec().with_uniform_weights(from), 8).unwrap(),
            "llama",
            &path,
        )
        .unwrap();
        let (_, converted) =
            ModelWeights::from_gguf(&tiny_k_spec().with_uniform_weights(to), &read_header(&path).unwrap())
                .unwrap();
        let arrow = format!("{from} → {to}");
        assert!(converted.iter().all(|c| c.ends_with(&arrow)) && !converted.is_empty(), "{converted:?}");
    }
    // A tensor of another model is missing from this one: an error naming the tensor and the file.
    let e = ModelWeights::from_gguf(&tiny_spec().with_uniform_weights(DType::Bf16), &header).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ExecError::Checkpoint { .. }) && msg.contains("bf16.gguf"), "{msg}");
}
