//! The Z-Image transformer under group offload: its refiner and main blocks stream through the device one
//! group at a time, prefetched in the captured call order, while the layers outside the blocks (embedders, final
//! layer, pad tokens, about 23 MiB at the real size) stay resident.

use std::sync::Arc;

use burn::tensor::{Device, Tensor};
use group_offload::{BlockOffload, GroupOffload, GroupOffloadConfig, GroupOffloadedModel, ModuleOffload, Placement as Residency};
use offload_core::{ComponentError, DeviceLedger, DeviceName, Offloadable};

use crate::error::Result;
use crate::transformer::{ZImageBlock, ZImageTransformer2DModel};

/// A `ZImageTransformer2DModel` taken apart for group offload, and registered with the manager as a
/// group-offloaded component (never evicted wholesale; its resident bytes count in the strategy's view).
pub struct GroupedTransformer {
    model: GroupOffloadedModel,
    shell: ModuleOffload<ZImageTransformer2DModel>,
    noise_refiner: BlockOffload<ZImageBlock>,
    context_refiner: BlockOffload<ZImageBlock>,
    layers: BlockOffload<ZImageBlock>,
    ledger: Arc<dyn DeviceLedger>,
    exec: Device,
}

impl std::fmt::Debug for GroupedTransformer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupedTransformer").field("groups", &self.model.offload().groups().len()).finish()
    }
}

impl GroupedTransformer {
    /// Takes `transformer` apart into groups of `blocks_per_group` blocks under `config` (its device, ledger,
    /// record and prefetch settings); `ledger` is charged each forward's activations.
    pub fn new(
        mut transformer: ZImageTransformer2DModel,
        config: GroupOffloadConfig,
        blocks_per_group: usize,
        ledger: Arc<dyn DeviceLedger>,
    ) -> Result<Self> {
        let exec = config.device.clone();
        let offload = GroupOffload::new(config)?;
        let noise_refiner = offload.blocks("noise_refiner", std::mem::take(&mut transformer.noise_refiner), blocks_per_group)?;
        let context_refiner =
            offload.blocks("context_refiner", std::mem::take(&mut transformer.context_refiner), blocks_per_group)?;
        let layers = offload.blocks("layers", std::mem::take(&mut transformer.layers), blocks_per_group)?;
        let shell = offload.module("shell", transformer, Residency::Resident)?;
        Ok(Self {
            model: GroupOffloadedModel::new(offload),
            shell,
            noise_refiner,
            context_refiner,
            layers,
            ledger,
            exec,
        })
    }

    /// The offloader, for its statistics and call order.
    pub fn offload(&self) -> &GroupOffload {
        self.model.offload()
    }

    /// The transformer's forward over items of possibly different sizes, one at a time (as
    /// [`ZImageTransformer2DModel::forward_items`]): `xs[i]` `[C, F, H, W]`, `t` `[n]`, `caps[i]` `[L_i, D_cap]`.
    pub fn forward_items(&self, xs: Vec<Tensor<4>>, t: Tensor<1>, caps: Vec<Tensor<2>>) -> Result<Vec<Tensor<4>>> {
        let mut outs = Vec::with_capacity(xs.len());
        for (i, (x, cap)) in xs.into_iter().zip(caps).enumerate() {
            let out = self.forward(x.unsqueeze_dim(0), t.clone().narrow(0, i, 1), cap.unsqueeze_dim(0))?;
            let [_, c, f, h, w] = out.dims();
            outs.push(out.reshape([c, f, h, w]));
        }
        Ok(outs)
    }

    /// One forward: `x` `[B, C, F, H, W]`, `t` `[B]`, `cap_feats` `[B, L, D_cap]` → `[B, C, F, H, W]`.
    pub fn forward(&self, x: Tensor<5>, t: Tensor<1>, cap_feats: Tensor<3>) -> Result<Tensor<5>> {
        self.offload().ensure_device(&x.device())?;
        let mut embedded = self.shell.get()?.embed(x, t, cap_feats);
        for group in self.noise_refiner.iter() {
            for block in group?.iter() {
                embedded.image = block.forward(embedded.image, &embedded.image_rope, Some(&embedded.adaln));
            }
        }
        for group in self.context_refiner.iter() {
            for block in group?.iter() {
                embedded.caption = block.forward(embedded.caption, &embedded.caption_rope, None);
            }
        }
        let mut state = embedded.unify();
        for group in self.layers.iter() {
            for block in group?.iter() {
                state = crate::transformer::block_forward(block, state);
            }
        }
        Ok(self.shell.get()?.finish(state))
    }

    /// Runs `f` with `activation_bytes` charged to the ledger, as [`crate::offload::BurnComponent::run`] does.
    pub fn run<R>(
        &mut self,
        activation_bytes: u64,
        f: impl FnOnce(&Self, &Device) -> Result<R>,
    ) -> std::result::Result<R, ComponentError> {
        self.ledger.allocate(activation_bytes)?;
        let result = f(self, &self.exec);
        self.ledger.free(activation_bytes);
        result.map_err(|error| match error {
            crate::Error::GroupOffload(inner) => ComponentError::from(inner),
            other => ComponentError::other(other),
        })
    }
}

impl Offloadable for GroupedTransformer {
    fn bytes(&self) -> u64 {
        self.model.bytes()
    }

    fn device(&self) -> DeviceName {
        self.model.device()
    }

    fn onload(&mut self, device: &DeviceName) -> std::result::Result<(), ComponentError> {
        self.model.onload(device)
    }

    fn offload(&mut self) -> std::result::Result<(), ComponentError> {
        Offloadable::offload(&mut self.model)
    }

    fn resident_bytes(&self) -> u64 {
        self.model.resident_bytes()
    }

    fn group_offloaded(&self) -> bool {
        true
    }

    fn class_name(&self) -> String {
        "ZImageTransformer2DModel (group offload)".into()
    }
}
