//! Fixture access shared by the pipeline's integration tests: the tiny checkpoint and diffusers' goldens.

#![allow(dead_code)] // Each test file uses a different part of it.

use std::collections::HashMap;
use std::path::PathBuf;

use burn::tensor::{DType, Device, Tensor, TensorData};

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
