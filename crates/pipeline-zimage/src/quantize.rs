//! Weight-only quantization of the pipeline's linear layers with burn's quantized tensors.
//!
//! [`quantize_linear_weights`] replaces the weight matrix of every [`PtLinear`](crate::nn::PtLinear) in a module with a burn quantized
//! tensor (8-bit symmetric, one f32 scale per tensor: [`QuantScheme`] with `Q8S`), leaving biases, norms,
//! embeddings, pad tokens and convolutions in their float dtype. The layers keep burn's own quantized kernels:
//! `PtLinear::forward` hands the quantized weight to `burn::tensor::module::linear`, which runs the backend's
//! quantized matmul (CUDA) or dequantizes the weight for the product (the CPU backend `flex`, which stores one
//! byte per value).
//!
//! A quantized component moves only whole: the manager onloads and offloads it with burn's `to_device`, which
//! keeps the quantized representation. Group offload moves float parameters, so it refuses quantized ones
//! (`group_offload::ModelHandle::enable_group_offload` returns `RouteUnsupported`), and the
//! planner never routes a quantized component to block or leaf offload.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::quantization::{QuantScheme, QuantStore, QuantValue};
use burn::tensor::{DType, Tensor};

/// The scheme [`quantize_linear_weights`] uses: 8-bit symmetric values, stored natively, one f32 scale per tensor.
pub fn int8_scheme() -> QuantScheme {
    QuantScheme::default().with_value(QuantValue::Q8S).with_store(QuantStore::Native)
}

/// `module` with the weight of every `PtLinear` quantized with `scheme` (dynamic min-max calibration); every
/// other parameter is left as it is. Returns the module and how many weights were quantized. Weights that are
/// already quantized are left alone.
pub fn quantize_linear_weights<M: Module>(module: M, scheme: &QuantScheme) -> (M, usize) {
    struct LinearWeights<'a> {
        scheme: &'a QuantScheme,
        /// The container type and field name of each module entered.
        stack: Vec<(String, String)>,
        count: usize,
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
            self.count += 1;
            let scheme = *self.scheme;
            param.map(|weight| weight.quantize_dynamic(&scheme))
        }
    }
    let mut mapper = LinearWeights { scheme, stack: Vec::new(), count: 0 };
    let module = module.map(&mut mapper);
    (module, mapper.count)
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

/// Quantizes the linear weights of a pipeline component with [`int8_scheme`]: the component is re-registered
/// with its new size (its id changes) and its weights stay quantized wherever the manager moves it. Returns how
/// many weights were quantized; does nothing the second time. Refused for a component under group offload, whose
/// host copies are float (quantize first: a quantized component then moves whole). A failure leaves the
/// component registered as it was.
pub fn quantize<M: group_offload::OffloadModel + Clone>(
    component: &mut group_offload::ModelHandle<M>,
) -> crate::Result<usize> {
    if component.is_grouped() {
        return Err(group_offload::Error::AlreadyApplied {
            component: component.name().to_string(),
            action: "quantize".into(),
            reason: "it is under group offload, whose host copies are float; quantize it before enabling offload \
                     (a quantized component moves whole)"
                .into(),
        }
        .into());
    }
    if component.is_quantized() {
        return Ok(0);
    }
    // A copy of the handles is quantized first, so nothing is unregistered until the quantized module exists.
    Ok(component.replace(|module| quantize_linear_weights(module, &int8_scheme()))?)
}
