//! Weight-only quantization of the pipeline's linear layers with burn's quantized tensors.
//!
//! [`quantize_linear_weights`] replaces the weight matrix of every [`PtLinear`](crate::nn::PtLinear) in a module with a burn quantized
//! tensor (by default 8-bit symmetric, one f32 scale per tensor: [`QuantScheme`] with `Q8S`, [`int8_scheme`];
//! [`quantize_with`] takes any scheme the backend computes, [`named_scheme`] reads one by name), leaving biases,
//! norms, embeddings, pad tokens and convolutions in their float dtype. The layers keep burn's own quantized
//! kernels: `PtLinear::forward` hands the quantized weight to `burn::tensor::module::linear`, which runs the
//! backend's quantized matmul (CUDA) or dequantizes the weight for the product (the CPU backend `flex`, which
//! stores one byte per value whatever the scheme's width).
//!
//! A quantized component moves whole or streams: the manager onloads and offloads it with burn's `to_device`,
//! which keeps the quantized representation (relabelled in the packed store where the execution device holds
//! 8-bit values only packed, as wgpu does: `group_offload::quant::repack`), and group offload streams it by blocks or leaves with its groups
//! holding the quantized bytes and scales as they are (`group_offload::ModelHandle::enable_group_offload`).
//! The planner routes it as a float component of the same (quantized) sizes. Quantize first, then stream: a
//! component already under group offload is refused ([`quantize`]). `docs/lora-and-quantization.md` has the
//! schemes, their accuracy on the tiny checkpoint and the bytes they stream.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::quantization::{BlockLayout, QuantScheme, QuantStore, QuantValue, ScaleDtype};
use burn::tensor::{DType, Tensor};

/// The scheme [`quantize_linear_weights`] uses: 8-bit symmetric values, stored natively, one f32 scale per tensor.
pub fn int8_scheme() -> QuantScheme {
    QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::Native)
}

/// `module` with the weight of every `PtLinear` quantized with `scheme` (dynamic min-max calibration); every
/// other parameter is left as it is. Returns the module and how many weights were quantized. Weights that are
/// already quantized are left alone.
pub fn quantize_linear_weights<M: Module>(module: M, scheme: &QuantScheme) -> (M, usize) {
    let (module, quantized) = quantize_fitting(module, scheme, None);
    (module, quantized.weights)
}

/// What quantizing a component did: how many linear weights were quantized and which were left in their float
/// dtype because the execution device could not hold them quantized (its packed store takes rows of a whole
/// number of words), by path and shape.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Quantized {
    /// Linear weights quantized.
    pub weights: usize,
    /// Linear weights left float, each with its shape.
    pub left_float: Vec<(String, Vec<usize>)>,
}

/// [`quantize_linear_weights`], leaving float every weight whose rows are not a whole number of `per_word` values
/// (where the execution device packs `per_word` values into each `u32` word).
fn quantize_fitting<M: Module>(module: M, scheme: &QuantScheme, per_word: Option<usize>) -> (M, Quantized) {
    struct LinearWeights<'a> {
        scheme: &'a QuantScheme,
        per_word: Option<usize>,
        /// The container type and field name of each module entered.
        stack: Vec<(String, String)>,
        done: Quantized,
    }
    impl ModuleMapper for LinearWeights<'_> {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.stack.push((name.to_string(), container_type.to_string()));
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }

        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let in_linear =
                self.stack.last().is_some_and(|(name, container)| name == "weight" && container == "Struct:PtLinear");
            if D != 2 || !in_linear || matches!(param.val().dtype(), DType::QFloat(_)) {
                return param;
            }
            let shape = param.shape().as_slice().to_vec();
            if self.per_word.is_some_and(|per_word| !shape[D - 1].is_multiple_of(per_word)) {
                let path = self.stack.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(".");
                self.done.left_float.push((path, shape));
                return param;
            }
            self.done.weights += 1;
            let scheme = *self.scheme;
            param.map(|weight| weight.quantize_dynamic(&scheme))
        }
    }
    let mut mapper = LinearWeights { scheme, per_word, stack: Vec::new(), done: Quantized::default() };
    let module = module.map(&mut mapper);
    (module, mapper.done)
}

/// How many of `module`'s float parameters are quantized.
pub fn quantized_params<M: Module>(module: &M) -> usize {
    struct Count(usize);
    impl ModuleVisitor for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if matches!(param.val().dtype(), DType::QFloat(_)) {
                self.0 += 1;
            }
        }
    }
    let mut count = Count(0);
    module.visit(&mut count);
    count.0
}

/// A scheme by the name the CLI takes: a value (`q8s`, `q4s`, `q2s`, `e4m3`, `e5m2`, `e2m1`), one f32 scale per
/// tensor and the native store, optionally followed by `-b<N>` for one f32 scale per block of `N` values along a
/// weight's rows (`q4s-b32`); `int8` is `q8s`. `None` for any other name.
pub fn named_scheme(name: &str) -> Option<QuantScheme> {
    let (value, block) = match name.split_once("-b") {
        Some((value, block)) => (value, Some(block.parse::<u8>().ok().filter(|b| *b > 0)?)),
        None => (name, None),
    };
    let value = match value.to_ascii_lowercase().as_str() {
        "q8s" | "int8" => QuantValue::Q8S,
        "q4s" => QuantValue::Q4S,
        "q2s" => QuantValue::Q2S,
        "e4m3" => QuantValue::E4M3,
        "e5m2" => QuantValue::E5M2,
        "e2m1" => QuantValue::E2M1,
        _ => return None,
    };
    let scheme = QuantScheme::default().with_value(value).with_store(QuantStore::Native);
    Some(match block {
        Some(block) => scheme.per_block([block], ScaleDtype::F32),
        None => scheme,
    })
}

/// The first `PtLinear` weight of `module` that `scheme`'s blocks do not tile, with its shape: burn quantizes a
/// tensor by blocks only when every dimension is a whole number of them.
fn untiled_weight<M: Module>(module: &M, scheme: &QuantScheme) -> Option<(String, Vec<usize>)> {
    struct Tiles<'a> {
        scheme: &'a QuantScheme,
        stack: Vec<(String, String)>,
        first: Option<(String, Vec<usize>)>,
    }
    impl ModuleVisitor for Tiles<'_> {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.stack.push((name.to_string(), container_type.to_string()));
        }

        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
        }

        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let in_linear =
                self.stack.last().is_some_and(|(name, container)| name == "weight" && container == "Struct:PtLinear");
            let (Some(block), true, None) = (self.scheme.block_size(), in_linear, &self.first) else { return };
            let shape = param.shape();
            if !BlockLayout::new(&shape, &block).divides() {
                let path = self.stack.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>().join(".");
                self.first = Some((path, shape.as_slice().to_vec()));
            }
        }
    }
    let mut tiles = Tiles { scheme, stack: Vec::new(), first: None };
    module.visit(&mut tiles);
    tiles.first
}

/// Quantizes the linear weights of a pipeline component with [`int8_scheme`] ([`quantize_with`]).
pub fn quantize<M: group_offload::OffloadModel + Clone>(
    component: &mut group_offload::ModelHandle<M>,
) -> crate::Result<usize> {
    Ok(quantize_with(component, &int8_scheme())?.weights)
}

/// Quantizes the linear weights of a pipeline component with `scheme`: the component is re-registered with its
/// new size (its id changes) and its weights stay quantized wherever the manager moves it, whole or streamed by
/// group offload. Returns what was quantized ([`Quantized`]); does nothing when it already is quantized.
///
/// The host copies are quantized on the placement's host backend (`flex`, one byte a value); an execution device
/// that holds 8-bit values only packed four to a `u32` (wgpu) gets the same bytes relabelled at each move
/// (`group_offload::quant::repack`), and a weight whose rows are not a whole number of words there is left float
/// and listed in [`Quantized::left_float`].
///
/// Refused, with nothing changed: for a component under group offload (quantize first, then stream: its groups
/// were cut from the float weights), for a scheme that the backend of its placement's host does not compute or
/// whose tensors its execution device cannot hold (`group_offload::quant::check_placement`, a
/// `group_offload::Error::SchemeUnsupported` naming the scheme: `flex` has no fp8 or fp4 values, and its 4- and
/// 2-bit tensors, one byte a value, would be packed smaller on wgpu than every size counted from them), and for a
/// per-block scheme whose blocks do not tile a weight.
pub fn quantize_with<M: group_offload::OffloadModel + Clone>(
    component: &mut group_offload::ModelHandle<M>,
    scheme: &QuantScheme,
) -> crate::Result<Quantized> {
    if component.is_grouped() {
        return Err(group_offload::Error::AlreadyApplied {
            component: component.name().to_string(),
            action: "quantize".into(),
            reason: "it is under group offload, whose groups were cut from its float weights; quantize it before \
                     enabling offload (a quantized component then streams its quantized bytes)"
                .into(),
        }
        .into());
    }
    if component.is_quantized() {
        return Ok(Quantized::default());
    }
    // The weights are quantized where the component's host copy lives (its placement's host device, the CPU
    // backend), and run on its execution device, which must hold what the host made of the scheme.
    let placement = component.placement();
    group_offload::quant::check_placement(component.name(), scheme, placement.host(), placement.exec())?;
    if let Some((weight, shape)) = component.inspect(|module| untiled_weight(module, scheme))? {
        return Err(group_offload::Error::SchemeUnsupported {
            component: component.name().to_string(),
            scheme: group_offload::quant::scheme_name(scheme),
            device: format!("{:?}", component.placement().exec()),
            reason: format!("its blocks do not tile {weight} of shape {shape:?}"),
            supported: "a block size that divides every linear weight's dimensions, or one scale per tensor".into(),
        }
        .into());
    }
    // Where the execution device packs what the host stores one a byte, a weight whose rows are not a whole
    // number of words stays float (as diffusers' quantizers leave the layers they cannot convert).
    let produced = group_offload::quant::produced_scheme(scheme, placement.host());
    let per_word = group_offload::quant::device_scheme(&produced, placement.exec())
        .filter(|stored| *stored != produced)
        .map(|stored| 32 / stored.value.size_bits());
    // A copy of the handles is quantized first, so nothing is unregistered until the quantized module exists.
    Ok(component.replace(|module| quantize_fitting(module, scheme, per_word))?)
}
