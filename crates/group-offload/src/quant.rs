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

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::quantization::quantized_data_len;
use burn::tensor::quantization::{QuantMode, QuantScheme, QuantStore, QuantValue, quantizable};
use burn::tensor::{Bytes, DType, Device, Shape, Tensor, TensorData};

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
/// computes `scheme`, and `exec` holds the tensors `host` makes of it ([`produced_scheme`]), as they are or
/// [`repack`]ed into its packed store ([`device_scheme`]: 8-bit values stored one a byte are already four to a
/// little-endian `u32`; 4- and 2-bit values are packed eight or sixteen to a word, and every size counted for
/// `exec` is the packed one: `whole::tensor_bytes_on`). The first refusal is returned,
/// naming the device it comes from.
pub fn check_placement(component: &str, scheme: &QuantScheme, host: &Device, exec: &Device) -> Result<()> {
    check_scheme(component, scheme, host)?;
    if exec == host {
        return Ok(());
    }
    let produced = produced_scheme(scheme, host);
    let refusal = |device: &Device, reason: String| Error::SchemeUnsupported {
        component: component.to_string(),
        scheme: scheme_name(scheme),
        device: format!("{device:?}"),
        reason,
        supported: placement_values(host, exec).iter().map(|v| format!("{v:?}")).collect::<Vec<_>>().join(", "),
    };
    match device_scheme(&produced, exec) {
        Some(stored) => match product_refusal(&produced, &stored, host, exec) {
            None => Ok(()),
            Some(reason) => Err(refusal(exec, reason)),
        },
        None => check_scheme(component, &produced, exec).map_err(|error| match error {
            Error::SchemeUnsupported { reason, .. } if produced != *scheme => refusal(
                exec,
                format!("the host copies' device ({host:?}) stores it as {}, and {reason}", scheme_name(&produced)),
            ),
            other => other,
        }),
    }
}

/// The values (per-tensor f32 scale) a module quantized on `host` can run with on `exec`
/// ([`check_placement`]'s rules, probes included).
pub fn placement_values(host: &Device, exec: &Device) -> Vec<QuantValue> {
    supported_values(host)
        .into_iter()
        .filter(|value| {
            let scheme = QuantScheme::default().with_value(*value);
            let produced = produced_scheme(&scheme, host);
            exec == host
                || device_scheme(&produced, exec)
                    .is_some_and(|stored| product_refusal(&produced, &stored, host, exec).is_none())
        })
        .collect()
}

/// Why `exec` cannot compute a linear layer whose weight `host` quantized as `produced` and `exec` holds as
/// `stored`, or `None` when it can: a probe, a `[16, 256]` input times a `[64, 256]` weight transposed (the
/// pipeline's `PtLinear` product) on `exec`, read back. burn's kernels choose their tiles by the device's limits,
/// and some schemes' exceed them (measured on lavapipe: a 2-bit weight's matmul asks for 81,920 bytes of shared
/// memory where the device gives 32,768, and burn-cubecl panics); the probe is the library's own device operation,
/// so its panic is caught and named here rather than in the first forward.
fn product_refusal(produced: &QuantScheme, stored: &QuantScheme, host: &Device, exec: &Device) -> Option<String> {
    if exec == host {
        return None;
    }
    let (d_out, d_in) = match produced.block_size() {
        Some(block) => {
            let dims: Vec<usize> = block.to_dim_vec(2).into_iter().map(usize::from).collect();
            (dims[0].max(1) * 64usize.div_ceil(dims[0].max(1)), dims[1].max(1) * 256usize.div_ceil(dims[1].max(1)))
        }
        None => (64, 256),
    };
    let values: Vec<f32> = (0..d_out * d_in).map(|i| ((i * 37 % 23) as f32 - 11.0) / 64.0).collect();
    let weight = Tensor::<2>::from_data(TensorData::new(values, [d_out, d_in]), host).quantize_dynamic(produced);
    let probe = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> std::result::Result<f32, String> {
        let data = repack(weight.into_data(), stored)?;
        let weight = Tensor::<2>::from_data(data, (exec, DType::QFloat(*stored)));
        let x = Tensor::<2>::ones([16, d_in], exec);
        let y = burn::tensor::module::linear(x, weight.transpose(), None);
        y.abs().sum().into_data().try_to_vec::<f32>().map_err(|e| format!("{e:?}")).map(|v| v[0])
    }));
    match probe {
        Ok(Ok(sum)) if sum.is_finite() => None,
        Ok(Ok(sum)) => Some(format!("a linear product with such a weight gave {sum} on this device")),
        Ok(Err(message)) => Some(message),
        Err(panic) => {
            let message = crate::device::panic_text(panic.as_ref());
            let first = message.lines().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
            let first = first.strip_prefix("called `Result::unwrap()` on an `Err` value: ").unwrap_or(first);
            Some(format!("burn cannot compute a linear layer with such a weight on this device ({first})"))
        }
    }
}

/// The scheme `exec` holds a tensor quantized as `scheme` in: `scheme` itself where `exec` takes it; for integer
/// values stored one a byte (`QuantStore::Native`, how `flex` stores every scheme) that `exec` does not take, the
/// same values and scales packed in little-endian `u32` words along the innermost axis (`PackedU32(0)`, how the
/// cubecl runtimes store them) where `exec` takes that; `None` when `exec` holds neither.
pub fn device_scheme(scheme: &QuantScheme, exec: &Device) -> Option<QuantScheme> {
    if unsupported(scheme, exec).is_none() {
        return Some(*scheme);
    }
    let integer = matches!(
        scheme.value,
        QuantValue::Q8S | QuantValue::Q8F | QuantValue::Q4S | QuantValue::Q4F | QuantValue::Q2S | QuantValue::Q2F
    );
    if scheme.store != QuantStore::Native || !integer {
        return None;
    }
    let packed = scheme.with_store(QuantStore::PackedU32(0));
    unsupported(&packed, exec).is_none().then_some(packed)
}

/// `data` (a quantized tensor's bytes, burn's `TensorData` layout: values, then scales aligned to 4 bytes) in the
/// layout of `target`, a scheme with the same values and scales: unchanged when `target` is its own scheme; from
/// the native store (one `i8` a value) to `PackedU32(0)` by packing `32 / bits` values into each little-endian
/// word, value `i` of a word at bit `i * bits` (burn's `pack_i8s_to_u32s` order). The values and the scales are
/// never dequantized: an 8-bit tensor keeps its very bytes and only changes its label. Fails, naming the shape,
/// when the innermost dimension is not a whole number of words (the cubecl runtimes pack each row on its own).
pub fn repack(data: TensorData, target: &QuantScheme) -> std::result::Result<TensorData, String> {
    let DType::QFloat(source) = data.dtype() else {
        return Err(format!("a {:?} tensor is not quantized and has nothing to repack", data.dtype()));
    };
    if source == *target {
        return Ok(data);
    }
    if source.with_store(target.store) != *target
        || source.store != QuantStore::Native
        || target.store != QuantStore::PackedU32(0)
    {
        return Err(format!(
            "{} cannot be repacked as {}: only the native store's integer values pack into u32 words, with the \
             same values and scales",
            scheme_name(&source),
            scheme_name(target)
        ));
    }
    let shape = data.shape().clone();
    let bits = target.value.size_bits();
    let per_word = 32 / bits;
    let innermost = shape.as_slice().last().copied().unwrap_or(1);
    if innermost % per_word != 0 {
        return Err(format!(
            "a tensor of shape {:?} cannot be packed {per_word} values to a u32 word along its innermost dimension \
             ({innermost} is not a multiple of {per_word}); leave it unquantized or keep it on the host's backend",
            shape.as_slice()
        ));
    }
    let values = shape.num_elements();
    let (bytes, _, _) = data.into_parts();
    let scales_at = values.next_multiple_of(4);
    if bytes.len() < scales_at {
        return Err(format!(
            "{} bytes hold fewer than the {values} values of a quantized tensor of shape {:?}",
            bytes.len(),
            shape.as_slice()
        ));
    }
    if bits == 8 {
        // Four i8 values in a little-endian u32 are the same bytes in the same order, and the native layout already
        // pads the values to the scales' 4-byte alignment: a relabel.
        return Ok(TensorData::from_bytes(bytes, shape, DType::QFloat(*target)));
    }
    let mask = (1u32 << bits) - 1;
    let mut packed = Vec::with_capacity(values / per_word * 4 + bytes.len() - scales_at);
    for word in bytes[..values].chunks(per_word) {
        let word = word.iter().enumerate().fold(0u32, |acc, (i, value)| acc | ((*value as u32) & mask) << (i * bits));
        packed.extend_from_slice(&word.to_le_bytes());
    }
    packed.extend_from_slice(&bytes[scales_at..]);
    Ok(TensorData::from_bytes(Bytes::from_bytes_vec(packed), shape, DType::QFloat(*target)))
}

/// `module` moved to `exec` (burn's `to_device`), each quantized parameter `exec` holds only in its packed store
/// rebuilt there from its bytes [`repack`]ed into [`device_scheme`]'s store, never dequantized. A parameter whose
/// bytes do not pack fails the move, naming it; one `exec` holds in no store moves as burn moves it.
pub fn module_to_device<M: Module>(module: M, exec: &Device) -> std::result::Result<M, String> {
    struct Repacker<'a> {
        exec: &'a Device,
        stack: Vec<String>,
        failure: Option<String>,
    }
    impl ModuleMapper for Repacker<'_> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.stack.push(name.to_string());
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }

        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let DType::QFloat(scheme) = param.val().dtype() else { return param };
            // A scheme `exec` holds as it is, or in no store (burn's `to_device` is left to judge it), moves as
            // it is.
            let Some(target) = device_scheme(&scheme, self.exec).filter(|target| *target != scheme) else {
                return param;
            };
            if self.failure.is_some() {
                return param;
            }
            let path = self.stack.join(".");
            let exec = self.exec.clone();
            let mut failure = None;
            let moved = param.map(|tensor| match tensor.clone().try_into_data().map_err(|e| format!("{e:?}")) {
                Ok(data) => match repack(data, &target) {
                    Ok(data) => Tensor::from_data(data, (&exec, DType::QFloat(target))),
                    Err(error) => {
                        failure = Some(format!("{path}: {error}"));
                        tensor
                    }
                },
                Err(error) => {
                    failure = Some(format!("{path}: reading it to the host failed: {error}"));
                    tensor
                }
            });
            self.failure = failure;
            moved
        }
    }
    let mut repacker = Repacker { exec, stack: Vec::new(), failure: None };
    let module = module.map(&mut repacker);
    match repacker.failure {
        Some(failure) => Err(failure),
        None => Ok(module.to_device(exec)),
    }
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

/// The bytes of a tensor of `shape` and `dtype` as `exec` holds it (`whole::tensor_bytes_on`'s rule, for a tensor
/// known only by its shape and dtype: a parameter bound to its file).
pub fn bytes_of(shape: &Shape, dtype: DType, exec: Option<&Device>) -> u64 {
    let bytes = match dtype {
        DType::QFloat(scheme) => {
            let stored = exec.and_then(|exec| device_scheme(&scheme, exec)).unwrap_or(scheme);
            quantized_data_len(&stored, shape)
        }
        dtype => shape.num_elements() * dtype.size(),
    };
    bytes as u64
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

    /// A tensor of `shape` quantized on flex with `value`, per tensor, and the values it holds.
    fn native(value: QuantValue, shape: [usize; 2]) -> (TensorData, Vec<i8>) {
        let scheme = QuantScheme::default().with_value(value).with_store(QuantStore::Native);
        let count = shape[0] * shape[1];
        let floats: Vec<f32> = (0..count).map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0).collect();
        let data = Tensor::<2>::from_data(TensorData::new(floats, shape), &Device::flex())
            .quantize_dynamic(&scheme)
            .into_data();
        let values = burn::tensor::quantization::QuantizedBytes {
            bytes: data.clone().into_bytes(),
            scheme,
            shape: shape.into(),
        }
        .into_vec_i8()
        .0;
        (data, values)
    }

    #[test]
    fn repacking_keeps_every_value_and_scale_and_an_8_bit_tensor_keeps_its_very_bytes() {
        for value in [QuantValue::Q8S, QuantValue::Q4S, QuantValue::Q2S] {
            let (data, values) = native(value, [3, 16]);
            let source = match data.dtype() {
                DType::QFloat(scheme) => scheme,
                other => panic!("{other:?}"),
            };
            let target = source.with_store(QuantStore::PackedU32(0));
            let packed = repack(data.clone(), &target).expect("repacks");
            assert_eq!(packed.dtype(), DType::QFloat(target));
            assert_eq!(packed.as_bytes().len(), quantized_data_len(&target, &[3, 16].into()), "{value:?}: length");
            let scale = |bytes: &[u8]| bytes[bytes.len() - 4..].to_vec();
            assert_eq!(scale(packed.as_bytes()), scale(data.as_bytes()), "{value:?}: the scale moved unchanged");
            let unpacked = burn::tensor::quantization::QuantizedBytes {
                bytes: packed.clone().into_bytes(),
                scheme: target,
                shape: [3, 16].into(),
            }
            .into_vec_i8()
            .0;
            assert_eq!(unpacked, values, "{value:?}: burn reads the packed words back as the same values");
            if value == QuantValue::Q8S {
                assert_eq!(packed.as_bytes(), data.as_bytes(), "8-bit values are the same bytes, relabelled");
            }
            // flex reads the packed tensor back as the values it quantized.
            let back = Tensor::<2>::from_data(packed, (&Device::flex(), DType::QFloat(target)));
            let dequantized = |t: Tensor<2>| t.dequantize().into_data().try_to_vec::<f32>().expect("f32");
            let original = Tensor::<2>::from_data(data, (&Device::flex(), DType::QFloat(source)));
            assert_eq!(dequantized(back), dequantized(original), "{value:?}: dequantized the same");
        }
    }

    #[test]
    fn repacking_refuses_rows_that_are_not_whole_words_and_other_schemes_by_name() {
        let (data, _) = native(QuantValue::Q8S, [2, 6]);
        let DType::QFloat(source) = data.dtype() else { unreachable!() };
        let error = repack(data.clone(), &source.with_store(QuantStore::PackedU32(0))).expect_err("rows of 6");
        assert!(error.contains("6 is not a multiple of 4"), "{error}");
        let other = source.with_value(QuantValue::Q4S).with_store(QuantStore::PackedU32(0));
        let error = repack(data, &other).expect_err("another value");
        assert!(error.contains("cannot be repacked"), "{error}");
    }

    #[test]
    fn the_cpu_backend_holds_every_integer_scheme_as_it_stores_it() {
        let scheme = QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::Native);
        assert_eq!(device_scheme(&scheme, &Device::flex()), Some(scheme));
    }
}
