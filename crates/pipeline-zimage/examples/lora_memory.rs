//! Host memory and time of fusing a LoRA into a transformer of a real layer size, and of removing it again.
//!
//! ```sh
//! cargo run -p pipeline-zimage --example lora_memory
//! ```
//!
//! Builds a Z-Image transformer with random f32 weights (Z-Image-Turbo's shape with `dim` 768 and 12 blocks, about
//! 90 M parameters), writes a rank-16 LoRA of every attention and feed-forward linear (in the diffusers/PEFT
//! layout, with updates about a thousandth of the weights, as a trained LoRA's) to a temporary file, fuses it,
//! and removes it, reading the process's anonymous memory (`RssAnon`) every millisecond. It prints the weights,
//! the file, the largest layer's update (what one layer's delta needs), the peak above the weights while fusing
//! and the record kept for the bit-exact removal, and checks the weights came back bit for bit.

use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use pipeline_zimage::config::TransformerConfig;
use pipeline_zimage::host::{AnonymousPeak, anonymous_bytes};
use pipeline_zimage::lora::{self, AppliedLoras, ComponentLayers, LoraFile, LoraMode, LoraSpec, LoraTarget};
use pipeline_zimage::transformer::ZImageTransformer2DModel;

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

/// A PEFT-layout LoRA of rank `rank` for every attention and feed-forward linear of `model`, its update about
/// `relative` times the weights' size.
fn write_lora(model: &ZImageTransformer2DModel, rank: usize, relative: f32, path: &std::path::Path) -> u64 {
    let mut seed = 1u64;
    let mut next = move || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    };
    let mut tensors: Vec<(String, Vec<u8>, Vec<usize>)> = Vec::new();
    for place in lora::linear_places(model) {
        if !(place.path.contains(".attention.") || place.path.contains(".feed_forward.")) {
            continue;
        }
        // Weights are N(0, 0.02); down · up sums `rank` products of two factors of this size.
        let size = (relative * 0.02 / rank as f32).sqrt() * 3f32.sqrt();
        let mut factor = |n: usize| (0..n).flat_map(|_| (next() * size).to_le_bytes()).collect::<Vec<u8>>();
        let key = format!("transformer.{}", place.path);
        tensors.push((format!("{key}.lora_A.weight"), factor(rank * place.d_in), vec![rank, place.d_in]));
        tensors.push((format!("{key}.lora_B.weight"), factor(place.d_out * rank), vec![place.d_out, rank]));
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

fn main() {
    let config = TransformerConfig {
        dim: 768,
        n_heads: 6,
        n_kv_heads: 6,
        n_layers: 8,
        cap_feat_dim: 768,
        ..TransformerConfig::z_image_turbo()
    };
    let mut model = ZImageTransformer2DModel::new(&config, &Device::flex());
    let base = weight_bits(&model);
    let weights: u64 = base.iter().map(|b| b.len() as u64).sum();
    let path = std::env::temp_dir().join(format!("lora-memory-{}.safetensors", std::process::id()));
    let file_bytes = write_lora(&model, 16, 1e-3, &path);
    let largest_delta = lora::linear_places(&model).iter().map(|p| p.d_out * p.d_in * 4).max().unwrap_or(0) as u64;

    let file = LoraFile::read(&path).expect("the LoRA reads");
    let layers = ComponentLayers::transformer(&model);
    let resolved = lora::resolve(&[(file, 1.0)], &layers, &ComponentLayers::none()).expect("it resolves");
    drop(layers);
    let before = anonymous_bytes();
    let peak = AnonymousPeak::start(Duration::from_millis(1));
    let mut applied = AppliedLoras::new(vec![LoraSpec::new(&path, 1.0)], LoraMode::Fused, Vec::new());
    let start = Instant::now();
    lora::apply(&mut model, LoraTarget::Transformer, &resolved, &mut applied);
    let fuse = start.elapsed();
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
        "weights {:.1} MB (f32), LoRA file {:.1} MB (rank 16, {} layers), largest layer's update {:.1} MB",
        mb(weights),
        mb(file_bytes),
        applied.layers(LoraTarget::Transformer),
        mb(largest_delta)
    );
    println!(
        "fuse: {:.2} s, anonymous memory {:.1} MB before (weights, the file's factors and the base copy this \
         example keeps to compare), peak {:+.1} MB above it, {:+.1} MB after",
        fuse.as_secs_f64(),
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
