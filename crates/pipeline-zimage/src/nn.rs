//! Layers whose parameter names and layouts match the PyTorch (diffusers / transformers) checkpoints.
//!
//! Every module here is loaded with burn-store's `IdentityAdapter` (see [`crate::loading`]): the field names are the
//! PyTorch names (`weight`, `bias`) and the tensors keep the PyTorch layout, so loading never transposes or renames
//! on the CPU, and the host bytes of a weight stay exactly the bytes in the safetensors file (which keeps the
//! offloader's uploads contiguous).
//!
//! Why not `burn::nn` directly:
//! - `burn::nn::Linear` (row layout) stores `[in, out]`; loading a PyTorch `[out, in]` matrix with the identity
//!   adapter would silently transpose every *square* matrix. [`PtLinear`] stores `[out, in]` and transposes a
//!   stride view at `forward` time.
//! - `burn::nn::RmsNorm`, `LayerNorm` and `GroupNorm` call their scale `gamma` and shift `beta`; the checkpoints
//!   say `weight` and `bias`. [`RmsNorm`] and [`GroupNorm`] use the checkpoint names and compute their statistics in
//!   f32 whatever the activation dtype, as PyTorch does for bf16.
//! - `burn::nn::conv::Conv2d` needs nothing: its `weight` is `[out, in/groups, kh, kw]` and its `bias` is `[out]`,
//!   exactly PyTorch's, so it loads with the identity adapter as is (`Conv2dConfig::new([c_in, c_out], [k, k])
//!   .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))` for a 3x3 "same" convolution).
//!
//! Parameters are created lazily (burn's `Initializer`), so building a 6B-parameter module allocates nothing until
//! a tensor is loaded into it; the loader replaces every parameter with the file's bytes.

use burn::module::{Initializer, Module, Param};
use burn::tensor::{DType, Device, Tensor};

/// A linear layer in PyTorch's layout: `y = x · weightᵀ + bias`, plus the low-rank terms of any LoRA applied at
/// run time ([`crate::lora::LoraMode::Runtime`]): `y += coefficient · (x · downᵀ) · upᵀ` for each.
///
/// Checkpoint keys: `<prefix>.weight` `[d_out, d_in]` and, when present, `<prefix>.bias` `[d_out]`. The
/// low-rank terms are never in a checkpoint: they are parameters of the layer (so group offload moves them with
/// the layer's group) that [`crate::lora`] adds and removes.
#[derive(Module, Debug)]
pub struct PtLinear {
    /// The weight matrix, `[d_out, d_in]` (PyTorch layout).
    pub weight: Param<Tensor<2>>,
    /// The optional bias, `[d_out]`.
    pub bias: Option<Param<Tensor<1>>>,
    /// The run-time LoRA terms, one per LoRA file that targets this layer; empty without LoRA.
    pub lora: Vec<LowRank>,
}

/// One LoRA's low-rank update of one [`PtLinear`], applied at run time: `coefficient · (x · downᵀ) · upᵀ`, the
/// PEFT `lora_B(lora_A(x)) · scaling` with the user's scale folded into `coefficient`.
#[derive(Module, Debug)]
pub struct LowRank {
    /// PEFT's `lora_A`, `[rank, d_in]`.
    pub down: Param<Tensor<2>>,
    /// PEFT's `lora_B`, `[d_out, rank]`.
    pub up: Param<Tensor<2>>,
    /// The user's scale times the adapter's `alpha / rank`.
    pub coefficient: f64,
}

impl LowRank {
    /// The term for `x` `[..., d_in]`: `[..., d_out]`, in `x`'s dtype.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let low = burn::tensor::module::linear(x, self.down.val().transpose(), None);
        burn::tensor::module::linear(low, self.up.val().transpose(), None) * self.coefficient
    }
}

impl PtLinear {
    /// Creates a layer with lazily initialised parameters (normal, std 0.02; bias zero) on `device`.
    pub fn new(d_in: usize, d_out: usize, bias: bool, device: &Device) -> Self {
        let weight = Initializer::Normal { mean: 0.0, std: 0.02 }.init([d_out, d_in], device);
        let bias = bias.then(|| Initializer::Zeros.init([d_out], device));
        Self { weight, bias, lora: Vec::new() }
    }

    /// The dtype the layer computes in: its weight's, or when the weight is quantized its bias's (F32 without
    /// a bias).
    pub fn dtype(&self) -> DType {
        match self.weight.val().dtype() {
            DType::QFloat(_) => self.bias.as_ref().map_or(DType::F32, |bias| bias.val().dtype()),
            dtype => dtype,
        }
    }

    /// The input width, `d_in`.
    pub fn d_in(&self) -> usize {
        self.weight.shape().dims::<2>()[1]
    }

    /// The output width, `d_out`.
    pub fn d_out(&self) -> usize {
        self.weight.shape().dims::<2>()[0]
    }

    /// Applies the layer to the last dimension.
    ///
    /// Shapes: `x` `[..., d_in]` -> `[..., d_out]`. `x` must have the weight's dtype; the result has it too.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        // The transpose is a stride view: the stored `[d_out, d_in]` bytes are never rewritten.
        let linear =
            |x| burn::tensor::module::linear(x, self.weight.val().transpose(), self.bias.as_ref().map(Param::val));
        if self.lora.is_empty() {
            return linear(x);
        }
        let y = linear(x.clone());
        self.lora.iter().fold(y, |y, term| y + term.forward(x.clone()))
    }
}

/// Root-mean-square normalisation over the last dimension, with a learnable scale named `weight`.
///
/// `y = (x / sqrt(mean(x²) + eps)) · weight`, with the mean square and the division done in f32 and the
/// normalised value cast to the weight's dtype before the scale (diffusers `RMSNorm`; for equal input and weight
/// dtypes this is also transformers' `Qwen3RMSNorm`).
///
/// Checkpoint key: `<prefix>.weight` `[dim]`.
#[derive(Module, Debug)]
pub struct RmsNorm {
    /// The learnable scale, `[dim]`.
    pub weight: Param<Tensor<1>>,
    /// Added to the mean square for numerical stability.
    pub eps: f64,
}

impl RmsNorm {
    /// Creates a norm over `dim` features with a lazily initialised scale of ones.
    pub fn new(dim: usize, eps: f64, device: &Device) -> Self {
        Self { weight: Initializer::Ones.init([dim], device), eps }
    }

    /// Normalises the last dimension.
    ///
    /// Shapes: `x` `[..., dim]` -> `[..., dim]`, in the weight's dtype.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let weight = self.weight.val();
        let x = x.cast(DType::F32);
        let inv_rms = (x.clone().square().mean_dim(D - 1) + self.eps).sqrt().recip();
        (x * inv_rms).cast(weight.dtype()) * weight.unsqueeze()
    }
}

/// Layer normalisation over the last dimension without learnable parameters
/// (PyTorch `LayerNorm(dim, elementwise_affine=False)`).
///
/// `y = (x - mean(x)) / sqrt(var(x) + eps)` with the biased variance, computed in f32 and cast back to `x`'s dtype.
/// Shapes: `x` `[..., dim]` -> `[..., dim]`.
pub fn layer_norm_no_affine<const D: usize>(x: Tensor<D>, eps: f64) -> Tensor<D> {
    let dtype = x.dtype();
    let x = x.cast(DType::F32);
    let centered = x.clone() - x.mean_dim(D - 1);
    let var = centered.clone().square().mean_dim(D - 1);
    (centered * (var + eps).sqrt().recip()).cast(dtype)
}

/// Group normalisation over `[batch, channels, ...]` with learnable per-channel `weight` and `bias`
/// (PyTorch `GroupNorm(num_groups, num_channels, eps, affine=True)`).
///
/// Statistics are computed in f32 per (batch, group) over the group's channels and all spatial positions; the
/// result is cast back to the input dtype before the affine transform.
///
/// Checkpoint keys: `<prefix>.weight` `[channels]`, `<prefix>.bias` `[channels]`.
#[derive(Module, Debug)]
pub struct GroupNorm {
    /// The per-channel scale, `[channels]`.
    pub weight: Param<Tensor<1>>,
    /// The per-channel shift, `[channels]`.
    pub bias: Param<Tensor<1>>,
    /// The number of channel groups; must divide the channel count.
    pub num_groups: usize,
    /// Added to the variance for numerical stability.
    pub eps: f64,
}

impl GroupNorm {
    /// Creates a norm over `channels` channels in `num_groups` groups (scale ones, shift zeros, lazily).
    pub fn new(num_groups: usize, channels: usize, eps: f64, device: &Device) -> Self {
        Self {
            weight: Initializer::Ones.init([channels], device),
            bias: Initializer::Zeros.init([channels], device),
            num_groups,
            eps,
        }
    }

    /// Normalises `x` `[batch, channels, height, width]` -> same shape, in the input dtype.
    pub fn forward(&self, x: Tensor<4>) -> Tensor<4> {
        let [b, c, h, w] = x.dims();
        let dtype = x.dtype();
        let g = self.num_groups;
        let grouped = x.cast(DType::F32).reshape([b, g, (c / g) * h * w]);
        let centered = grouped.clone() - grouped.mean_dim(2);
        let var = centered.clone().square().mean_dim(2);
        let normed = (centered * (var + self.eps).sqrt().recip()).reshape([b, c, h, w]).cast(dtype);
        let scale = self.weight.val().cast(dtype).reshape([1, c, 1, 1]);
        let shift = self.bias.val().cast(dtype).reshape([1, c, 1, 1]);
        normed * scale + shift
    }
}

/// The leaf predicate for this crate's models: burn's layers plus [`PtLinear`] and the text encoder's
/// `TokenEmbedding`. At leaf level each linear layer is a group, and the norms travel with the struct that holds
/// them (the root group `""` for a block's sandwich norms, `"attention"` for the per-head query and key norms).
pub fn leaf_types() -> group_offload::LeafPredicate {
    group_offload::LeafPredicate::default_layers().or_types(&["PtLinear", "TokenEmbedding"])
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    fn device() -> Device {
        Device::flex()
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.cast(DType::F32).into_data().try_into_vec::<f32>().expect("f32 data")
    }

    #[test]
    fn pt_linear_uses_pytorch_layout() {
        let dev = device();
        let mut lin = PtLinear::new(2, 3, true, &dev);
        // weight [out=3, in=2]
        lin.weight = Param::from_data(TensorData::new(vec![1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0], [3, 2]), &dev);
        lin.bias = Some(Param::from_data(TensorData::new(vec![0.5f32, 0.0, -1.0], [3]), &dev));
        let x = Tensor::<2>::from_data(TensorData::new(vec![2.0f32, 3.0], [1, 2]), &dev);
        assert_eq!(values(lin.forward(x)), vec![2.5, 3.0, 4.0]);
        assert_eq!((lin.d_in(), lin.d_out()), (2, 3));
    }

    #[test]
    fn rms_norm_matches_formula() {
        let dev = device();
        let norm = RmsNorm::new(2, 0.0, &dev);
        let x = Tensor::<2>::from_data(TensorData::new(vec![3.0f32, 4.0], [1, 2]), &dev);
        let rms = (12.5f32).sqrt();
        let got = values(norm.forward(x));
        assert!((got[0] - 3.0 / rms).abs() < 1e-6 && (got[1] - 4.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn layer_norm_centres_and_scales() {
        let dev = device();
        let x = Tensor::<2>::from_data(TensorData::new(vec![1.0f32, 3.0], [1, 2]), &dev);
        let got = values(layer_norm_no_affine(x, 0.0));
        assert!((got[0] + 1.0).abs() < 1e-6 && (got[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn group_norm_normalises_each_group() {
        let dev = device();
        let norm = GroupNorm::new(2, 4, 0.0, &dev);
        let x = Tensor::<4>::from_data(
            TensorData::new(vec![1.0f32, 3.0, 10.0, 10.0, 0.0, 2.0, 5.0, 7.0], [1, 4, 1, 2]),
            &dev,
        );
        let got = values(norm.forward(x));
        // Group 0 = channels 0,1 = [1,3,10,10]: mean 6, var 16.5.
        let s = 16.5f32.sqrt();
        assert!((got[0] - (1.0 - 6.0) / s).abs() < 1e-5);
        // Group 1 = [0,2,5,7]: mean 3.5, var 7.25.
        assert!((got[7] - (7.0 - 3.5) / 7.25f32.sqrt()).abs() < 1e-5);
    }
}
