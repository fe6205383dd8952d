//! Which of burn's quantization schemes the backend in use computes, checked before a model is quantized.
//!
//! Group offload moves whatever bytes a quantized tensor holds, so every scheme streams; what differs between
//! backends is whether quantizing with a scheme gives the values it names. Read from burn 0.22.1's sources:
//!
//! - The CPU backend `flex` (`burn-flex/src/ops/qtensor.rs`) quantizes every scheme to integers, `(x / scale)`
//!   rounded, clamped to the value's range and stored as one `i8` per value, its store rewritten to `Native`.
//!   The integer values (`Q8S`, `Q8F`, `Q4S`, `Q4F`, `Q2S`, `Q2F`) are computed as named, at one byte per value
//!   whatever the store asked for (a 4-bit tensor is as large as an 8-bit one there). The float values (`E4M3`,
//!   `E5M2`, `E2M1`) are not: they are rounded to integers and saturate at ±127, so they are refused. Per-tensor
//!   and per-block scales both work where the blocks divide the tensor; lookup tables do not travel as tensors.
//! - The cubecl backends (wgpu, CUDA) carry every value type as packed words with their own kernels; what a
//!   runtime can hold is burn's own answer, [`Device::supports_dtype`], which checks the scale and storage types
//!   on that device.

use burn::tensor::quantization::{QuantMode, QuantScheme, QuantStore, QuantValue, quantizable};
use burn::tensor::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// A scheme as messages and reports name it: `Q8S, native store, per-tensor F32 scale`.
pub fn scheme_name(scheme: &QuantScheme) -> String {
    let store = match scheme.store {
        QuantStore::Native => "native store".to_string(),
        QuantStore::PackedNative(dim) => format!("packed native store (dim {dim})"),
        QuantStore::PackedU32(dim) => format!("packed u32 store (dim {dim})"),
    };
    let mut levels = Vec::new();
    if let Some(block) = scheme.block_scale() {
        levels.push(format!("per-block {:?} {:?} scales", block.size.as_slice(), block.dtype));
    }
    if let Some(tensor) = scheme.tensor_scale() {
        levels.push(format!("per-tensor {tensor:?} scale"));
    }
    let mode = match scheme.mode {
        QuantMode::Symmetric => "",
        QuantMode::Lookup => ", lookup table",
    };
    format!("{:?}, {store}, {}{mode}", scheme.value, levels.join(" over "))
}

/// The schemes `device`'s backend computes, among the ones a user is offered (values `Q8S`, `Q4S`, `Q2S`,
/// `E4M3`, `E5M2`, `E2M1` with a per-tensor f32 scale), by name.
pub fn supported_values(device: &Device) -> Vec<QuantValue> {
    [QuantValue::Q8S, QuantValue::Q4S, QuantValue::Q2S, QuantValue::E4M3, QuantValue::E5M2, QuantValue::E2M1]
        .into_iter()
        .filter(|value| unsupported(&QuantScheme::default().with_value(*value), device).is_none())
        .collect()
}

/// Why `device`'s backend does not compute `scheme`, or `None` when it does.
fn unsupported(scheme: &QuantScheme, device: &Device) -> Option<String> {
    if scheme.mode == QuantMode::Lookup {
        return Some("a lookup-table scheme does not travel as a quantized tensor in burn 0.22".into());
    }
    if !quantizable(scheme) {
        return Some(
            "burn cannot quantize against these scales (a two-level scheme needs a block dtype no wider \
                     than f16 under an f32 per-tensor scale)"
                .into(),
        );
    }
    if *device == Device::flex() {
        return match scheme.value {
            QuantValue::E4M3 | QuantValue::E5M2 | QuantValue::E2M1 => Some(format!(
                "the CPU backend flex quantizes every scheme to integers stored as i8, so {:?} values would be \
                 rounded to whole numbers and saturate at ±127 instead of being encoded as floats",
                scheme.value
            )),
            _ => None,
        };
    }
    if scheme.store == QuantStore::Native && scheme.value.size_bits() < 8 {
        // burn-cubecl's `q_from_data` panics on these ("Can't store native sub-byte values").
        return Some("a cubecl runtime stores sub-byte values packed only, never one per byte".into());
    }
    if !device.supports_dtype(DType::QFloat(*scheme)) {
        return Some("burn reports that this device cannot hold it (its scale or storage type)".into());
    }
    None
}

/// The scheme of the tensors `device`'s backend makes when it quantizes with `scheme`: backends may rewrite it
/// (`flex` stores every scheme `Native`, one byte per value). Read from a probe of one block (or one row of 32
/// values) quantized on `device`; `scheme` itself where the probe comes back unquantized.
pub fn produced_scheme(scheme: &QuantScheme, device: &Device) -> QuantScheme {
    let dims: Vec<usize> = match scheme.block_size() {
        Some(block) => block.to_dim_vec(2).into_iter().map(usize::from).collect(),
        None => vec![1, 32],
    };
    let probe = Tensor::<2>::ones([dims[0], dims[1]], device).quantize_dynamic(scheme);
    match probe.dtype() {
        DType::QFloat(produced) => produced,
        _ => *scheme,
    }
}

/// Checks that a module quantized with `scheme` on `host` (where its host copy lives) can run on `exec`: `host`
/// computes `scheme`, and `exec` holds the tensors `host` makes of it ([`produced_scheme`]). The first refusal
/// is returned, naming the device it comes from.
pub fn check_placement(component: &str, scheme: &QuantScheme, host: &Device, exec: &Device) -> Result<()> {
    check_scheme(component, scheme, host)?;
    if exec == host {
        return Ok(());
    }
    let produced = produced_scheme(scheme, host);
    check_scheme(component, &produced, exec).map_err(|error| match error {
        Error::SchemeUnsupported { component, device, reason, supported, .. } if produced != *scheme => {
            Error::SchemeUnsupported {
                component,
                scheme: scheme_name(scheme),
                device,
                reason: format!(
                    "the host copies' device ({host:?}) stores it as {}, and {reason}",
                    scheme_name(&produced)
                ),
                supported,
            }
        }
        other => other,
    })
}

/// Checks that `device`'s backend computes `scheme`, before `component` is quantized with it; a
/// [`Error::SchemeUnsupported`] names the scheme, what the backend would do with it, and the schemes that work.
pub fn check_scheme(component: &str, scheme: &QuantScheme, device: &Device) -> Result<()> {
    match unsupported(scheme, device) {
        None => Ok(()),
        Some(reason) => Err(Error::SchemeUnsupported {
            component: component.to_string(),
            scheme: scheme_name(scheme),
            device: format!("{device:?}"),
            reason,
            supported: supported_values(device).iter().map(|v| format!("{v:?}")).collect::<Vec<_>>().join(", "),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest difference between `values` and their round trip through `scheme` on flex.
    fn round_trip_error(scheme: &QuantScheme, values: &[f32]) -> f32 {
        let device = Device::flex();
        let tensor = Tensor::<1>::from_floats(values, &device);
        let back: Vec<f32> =
            tensor.clone().quantize_dynamic(scheme).dequantize().into_data().try_to_vec().expect("f32");
        values.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max)
    }

    #[test]
    fn flex_computes_the_integer_schemes_and_refuses_the_float_ones_by_name() {
        let device = Device::flex();
        let values: Vec<f32> = (0..64).map(|i| i as f32 / 32.0 - 1.0).collect();
        // The integer schemes round to their grid: half a step of 1/127, 1/7 and 1/1 of the largest value.
        for (value, bound) in [(QuantValue::Q8S, 0.5 / 127.0), (QuantValue::Q4S, 0.5 / 7.0), (QuantValue::Q2S, 0.5)] {
            let scheme = QuantScheme::default().with_value(value).with_store(QuantStore::Native);
            check_scheme("net", &scheme, &device).expect("computed on flex");
            let error = round_trip_error(&scheme, &values);
            assert!(error <= bound + 1e-6, "{value:?}: {error} over {bound}");
        }
        // What flex would do with E4M3: integers clamped at 127 of 448 steps, far from an fp8 encoding (whose
        // error at 1.0 is at most 1/16). That is why it is refused.
        let e4m3 = QuantScheme::default().with_value(QuantValue::E4M3).with_store(QuantStore::Native);
        assert!(round_trip_error(&e4m3, &values) > 0.5, "flex saturates E4M3 values");
        let error = check_scheme("net", &e4m3, &device).expect_err("refused");
        let message = error.to_string();
        assert!(matches!(error, Error::SchemeUnsupported { .. }), "{message}");
        assert!(message.contains("E4M3") && message.contains("net") && message.contains("Q8S"), "{message}");
        assert_eq!(supported_values(&device), vec![QuantValue::Q8S, QuantValue::Q4S, QuantValue::Q2S]);
    }

    #[test]
    fn flex_stores_every_scheme_natively_whatever_the_store_asked_for() {
        let device = Device::flex();
        let packed = QuantScheme::default().with_value(QuantValue::Q4S).with_store(QuantStore::PackedU32(0));
        assert_eq!(produced_scheme(&packed, &device), packed.with_store(QuantStore::Native));
        check_placement("net", &packed, &device, &device).expect("flex on flex");
    }

    #[test]
    fn a_scheme_is_named_by_its_value_store_and_scales() {
        let scheme = QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::Native);
        assert_eq!(scheme_name(&scheme), "Q8S, native store, per-tensor F32 scale");
    }
}
