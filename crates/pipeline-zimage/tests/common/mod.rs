//! Fixture access shared by the pipeline's integration tests: the tiny checkpoint and diffusers' goldens.

#![allow(dead_code)] // Each test file uses a different part of it.

use std::collections::HashMap;
use std::path::PathBuf;

use burn::tensor::{DType, Device, Tensor, TensorData};
use group_offload::OffloadDevice;
use pipeline_zimage::loading::LoadOptions;
use pipeline_zimage::pipeline::{GenerateOptions, ZImagePipeline};

/// The f32 tensors of a golden file, by name: shape and values.
pub type Golden = HashMap<String, (Vec<usize>, Vec<f32>)>;

/// `tests/fixtures` of this crate.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Reads the f32 tensors of `tests/fixtures/golden/<name>`.
pub fn golden(name: &str) -> Golden {
    let path = fixtures().join("golden").join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    file.tensors()
        .into_iter()
        .filter(|(_, view)| view.dtype() == safetensors::Dtype::F32)
        .map(|(name, view)| {
            let values = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// A rank-4 golden tensor on the CPU, in f32.
pub fn tensor4(golden: &Golden, name: &str) -> Tensor<4> {
    let (shape, values) = golden.get(name).unwrap_or_else(|| panic!("golden tensor {name} missing"));
    let shape: [usize; 4] = shape.clone().try_into().expect("4 dimensions");
    Tensor::from_data(TensorData::new(values.clone(), shape), (&Device::flex(), DType::F32))
}

/// The tiny checkpoint loaded onto `placement`.
pub fn load_tiny(placement: OffloadDevice) -> ZImagePipeline {
    ZImagePipeline::load(fixtures().join("tiny-z-image-turbo"), placement, &LoadOptions::new())
        .expect("the tiny checkpoint loads")
}

/// The Turbo golden's options (64x64, 4 steps, 32 prompt tokens, its latents) and its image.
pub fn turbo_options() -> (GenerateOptions, Vec<f32>) {
    let g = golden("pipeline_t2i_turbo.safetensors");
    let mut opts = GenerateOptions::turbo("a red fox in the snow");
    opts.steps = 4;
    opts.height = 64;
    opts.width = 64;
    opts.max_sequence_length = 32;
    opts.latents = Some(tensor4(&g, "latents"));
    (opts, g["image"].1.clone())
}

/// A tensor's values as f32.
pub fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
    t.cast(DType::F32).into_data().try_into_vec::<f32>().expect("f32 data")
}

/// The largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "element counts differ");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Bytes of the component named `component` in the manager of its device (the execution device's, or another's
/// under a device map).
pub fn component_bytes(pipeline: &pipeline_zimage::pipeline::ZImagePipeline, component: &str) -> u64 {
    let id = pipeline.component(component).expect("a component of the pipeline").id();
    let info = pipeline.managers().find_map(|manager| manager.component_info(id).ok());
    info.expect("registered in one of the pipeline's managers").bytes
}
