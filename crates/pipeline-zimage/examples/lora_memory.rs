//! Host memory and time of fusing a LoRA into a transformer of a real layer size, the bytes its bit-exact removal
//! keeps for each size of update, in f32 and bf16, and the removal itself.
//!
//! ```sh
//! cargo run -p pipeline-zimage --example lora_memory
//! ```
//!
//! Builds a Z-Image transformer with random weights (Z-Image-Turbo's shape with `dim` 768 and 8 blocks, about
//! 90 M parameters, weights N(0, 0.02) as the model initialises them), writes a rank-16 LoRA of every attention
//! and feed-forward linear (diffusers/PEFT layout) to a temporary file, fuses it and removes it.
//!
//! - The record: for updates whose deviation is 1/1000, 1/100, 1/10, 1/2 and 1 times the weights' (a trained
//!   LoRA's is about 1/1000), in f32 and in bf16, the bytes kept per fused element, how many layers keep a
//!   plain copy of their weights (never more than that copy: 4 bytes an element in f32, 2 in bf16), and the
//!   update's deviation as measured on the f32 weights (fused minus base). Each removal is checked bit for bit.
//! - The memory: for the 1/1000 LoRA in f32, the process's anonymous memory (`RssAnon`) read every millisecond
//!   while fusing and removing, beside the weights, the file and the largest layer's update.

use std::time::{Duration, Instant};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, Device, Tensor};
use pipeline_zimage::config::TransformerConfig;
use pipeline_zimage::host::{AnonymousPeak, anonymous_bytes};
use pipeline_zimage::lora::{self, AppliedLoras, ComponentLayers, LoraFile, LoraMode, LoraSpec, LoraTarget};
use pipeline_zimage::transformer::ZImageTransformer2DModel;

/// The LoRA's rank.
const RANK: usize = 16;
/// The weights' deviation (`PtLinear`'s initialiser).
const WEIGHT_SIGMA: f32 = 0.02;

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// Every float parameter's bytes, in visit order (touching each one also materialises the lazy initialisation).
fn weight_bits<M: Module>(module: &M) -> Vec<Vec<u8>> {
    struct Bits(Vec<Vec<u8>>);
    impl ModuleVisitor for Bits {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().into_data().as_bytes().to_vec());
        }
    }
    let mut bits = Bits(Vec::new());
    module.visit(&mut bits);
    bits.0
}

/// `module` with every float parameter cast to `dtype`.
fn cast<M: Module>(module: M, dtype: DType) -> M {
    struct Cast(DType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|tensor| tensor.cast(dtype))
        }
    }
    module.map(&mut Cast(dtype))
}

/// A PEFT-layout LoRA of rank [`RANK`] for every attention and feed-forward linear of `model`, its update's
/// deviation about `relative` times the weights'; returns the file's bytes.
fn write_lora(model: &ZImageTransformer2DModel, relative: f32, path: &std::path::Path) -> u64 {
    let mut seed = 1u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    };
    // Factors uniform in [-s, s] have deviation s/√3; a sum of RANK products of two of them has deviation
    // √RANK · s²/3, which is set to `relative` times the weights' deviation.
    let s = (3.0 * relative * WEIGHT_SIGMA / (RANK as f32).sqrt()).sqrt();
    let mut tensors: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
    for place in lora::linear_places(model) {
        if !(place.path.contains(".attention.") || place.path.contains(".feed_forward.")) {
            continue;
        }
        let mut factor = |n: usize| (0..n).flat_map(|_| (next() * s).to_le_bytes()).collect::<Vec<u8>>();
        let key = format!("transformer.{}", place.path);
        tensors.push((format!("{key}.lora_A.weight"), factor(RANK * place.d_in), vec![RANK, place.d_in]));
        tensors.push((format!("{key}.lora_B.weight"), factor(place.d_out * RANK), vec![place.d_out, RANK]));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(key, bytes, shape)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes);
            (key.clone(), view.expect("a tensor"))
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("the LoRA file is written");
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

fn f64s(bytes: &[u8]) -> impl Iterator<Item = f64> + '_ {
    bytes.chunks_exact(4).map(|c| f64::from(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))
}

/// The deviation of `after - before` over the f32 parameters that changed, relative to the weights'.
fn measured_ratio(before: &[Vec<u8>], after: &[Vec<u8>]) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for (b, a) in before.iter().zip(after).filter(|(b, a)| b != a) {
        for (x, y) in f64s(b).zip(f64s(a)) {
            sum += (y - x) * (y - x);
            n += 1;
        }
    }
    (sum / n.max(1) as f64).sqrt() / f64::from(WEIGHT_SIGMA)
}

fn config() -> TransformerConfig {
    TransformerConfig {
        dim: 768,
        n_heads: 6,
        n_kv_heads: 6,
        n_layers: 8,
        cap_feat_dim: 768,
        ..TransformerConfig::z_image_turbo()
    }
}

/// Fuses the LoRA at `path` into `model` with [`lora::swap`] and returns what was applied.
fn fuse(model: &mut ZImageTransformer2DModel, path: &std::path::Path) -> AppliedLoras {
    let file = LoraFile::read(path).expect("the LoRA reads");
    let layers = ComponentLayers::transformer(model);
    let resolved = lora::resolve(&[(file, 1.0)], &layers, &ComponentLayers::none()).expect("it resolves");
    let mut applied = AppliedLoras::new(vec![LoraSpec::new(path, 1.0)], LoraMode::Fused, Vec::new());
    lora::swap(model, LoraTarget::Transformer, &AppliedLoras::default(), &resolved, &mut applied).expect("it fuses");
    applied
}

fn main() {
    let path = std::env::temp_dir().join(format!("lora-memory-{}.safetensors", std::process::id()));

    println!("the record a bit-exact removal keeps, rank {RANK}, every attention and feed-forward linear:");
    println!("| update σ / weight σ (asked, measured) | f32: bytes an element, plain copies | bf16: the same |");
    println!("|---|---|---|");
    for (label, relative) in [("1/1000", 1e-3), ("1/100", 1e-2), ("1/10", 1e-1), ("1/2", 0.5), ("1", 1.0)] {
        let mut row = Vec::new();
        let mut measured = 0.0;
        for dtype in [DType::F32, DType::BF16] {
            let mut model = cast(ZImageTransformer2DModel::new(&config(), &Device::flex()), dtype);
            let base = weight_bits(&model);
            write_lora(&model, relative, &path);
            let applied = fuse(&mut model, &path);
            if dtype == DType::F32 {
                measured = measured_ratio(&base, &weight_bits(&model));
            }
            let records = applied.records();
            let copies = records.iter().filter(|r| r.plain_copy).count();
            assert!(records.iter().all(|r| r.bytes <= r.copy_bytes), "never more than a plain copy");
            lora::remove(&mut model, LoraTarget::Transformer, &applied);
            assert!(weight_bits(&model) == base, "{dtype:?} at {label}: the base weights came back bit for bit");
            let per_element = applied.correction_bytes() as f64 / applied.fused_elements() as f64;
            row.push(format!("{per_element:.3}, {copies} of {}", records.len()));
        }
        println!("| {label} ({measured:.4}) | {} | {} |", row[0], row[1]);
    }

    let mut model = ZImageTransformer2DModel::new(&config(), &Device::flex());
    let base = weight_bits(&model);
    let weights: u64 = base.iter().map(|b| b.len() as u64).sum();
    let file_bytes = write_lora(&model, 1e-3, &path);
    let largest_delta = lora::linear_places(&model).iter().map(|p| p.d_out * p.d_in * 4).max().unwrap_or(0) as u64;
    let file = LoraFile::read(&path).expect("the LoRA reads");
    let layers = ComponentLayers::transformer(&model);
    let resolved = lora::resolve(&[(file, 1.0)], &layers, &ComponentLayers::none()).expect("it resolves");
    drop(layers);
    let before = anonymous_bytes();
    let peak = AnonymousPeak::start(Duration::from_millis(1));
    let mut applied = AppliedLoras::new(vec![LoraSpec::new(&path, 1.0)], LoraMode::Fused, Vec::new());
    let start = Instant::now();
    lora::swap(&mut model, LoraTarget::Transformer, &AppliedLoras::default(), &resolved, &mut applied).expect("fuses");
    let fuse_time = start.elapsed();
    let fuse_peak = peak.peak();
    let after = anonymous_bytes();
    assert_ne!(weight_bits(&model), base, "the LoRA changed the weights");
    peak.reset();
    let start = Instant::now();
    lora::remove(&mut model, LoraTarget::Transformer, &applied);
    let unfuse = start.elapsed();
    let remove_peak = peak.peak();
    let restored = weight_bits(&model) == base;
    let _ = std::fs::remove_file(&path);

    println!(
        "\nweights {:.1} MB (f32), LoRA file {:.1} MB (rank {RANK}, {} layers, update 1/1000 of the weights), largest \
         layer's update {:.1} MB",
        mb(weights),
        mb(file_bytes),
        applied.layers(LoraTarget::Transformer),
        mb(largest_delta)
    );
    println!(
        "fuse: {:.2} s, anonymous memory {:.1} MB before (weights, the file's factors and the base copy this \
         example keeps to compare), peak {:+.1} MB above it, {:+.1} MB after",
        fuse_time.as_secs_f64(),
        mb(before),
        mb(fuse_peak.saturating_sub(before)),
        after as f64 / 1e6 - before as f64 / 1e6
    );
    println!(
        "record for a bit-exact removal: {} of {} elements, {:.3} MB ({:.4} bytes an element)",
        applied.corrections(),
        applied.fused_elements(),
        mb(applied.correction_bytes() as u64),
        applied.correction_bytes() as f64 / applied.fused_elements().max(1) as f64
    );
    println!(
        "remove: {:.2} s, peak {:+.1} MB above the memory before fusing; weights restored bit for bit: {restored}",
        unfuse.as_secs_f64(),
        mb(remove_peak.saturating_sub(before))
    );
    assert!(restored, "the base weights came back bit for bit");
}
