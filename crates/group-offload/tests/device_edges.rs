//! The device layer's edges on the flex CPU backend: a whole onload that panics mid-upload gives its reservation
//! back, the `vulkaninfo` report's parser survives any text, and `vulkaninfo` is run under a deadline.

#![allow(clippy::unwrap_used)] // A test fails loudly at the first unexpected error.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::Device;
use common::{Model, hard_card};
use group_offload::{Placement, whole::BurnComponent};
use memory_sim::SimCard;
use offload_core::{ComponentError, DeviceLedger, DeviceMemory, DeviceName, Direction, Offloadable};

/// A ledger over the card whose host-to-device transfers panic while `panics` is set: a ledger bug in the middle of
/// an onload, after its reservation was made (not the device's failure, so nothing catches it).
struct PanicsInTransfer {
    card: Arc<SimCard>,
    panics: AtomicBool,
}

impl DeviceLedger for PanicsInTransfer {
    fn allocate(&self, bytes: u64) -> Result<(), ComponentError> {
        self.card.allocate(bytes)
    }

    fn free(&self, bytes: u64) {
        self.card.free(bytes)
    }

    fn allocate_tensors(&self, sizes: &[u64]) -> Result<(), ComponentError> {
        self.card.allocate_tensors(sizes)
    }

    fn free_tensors(&self, sizes: &[u64]) {
        self.card.free_tensors(sizes)
    }

    fn transfer(&self, bytes: u64, direction: Direction) -> Result<(), ComponentError> {
        assert!(!self.panics.load(Ordering::SeqCst), "a ledger bug in the middle of an upload");
        self.card.transfer(bytes, direction)
    }
}

/// A whole onload whose upload panics for a reason other than the device gives back the reservation it made: the
/// account is what it was, so the next refusal is not a false out-of-memory, and the next onload fits.
#[test]
fn a_whole_onload_that_panics_mid_upload_gives_its_reservation_back() {
    let card = hard_card(1 << 20);
    let ledger = Arc::new(PanicsInTransfer { card: card.clone(), panics: AtomicBool::new(true) });
    let name = DeviceName::parse("cuda").unwrap();
    let placement = Placement::on_device(Device::flex(), name.clone(), ledger.clone(), Some(card.clone()));
    let mut component = BurnComponent::new(Model::new(&Device::flex()), "model", placement);
    let before = card.allocated();
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| component.onload(&name)));
    assert!(unwound.is_err(), "the ledger's panic reached the caller");
    assert_eq!(card.allocated(), before, "the onload's reservation was given back");
    assert!(component.device().is_cpu(), "the component stayed on the host");
    // The account is whole: an onload that fits is granted, and its offload leaves the card as it was.
    ledger.panics.store(false, Ordering::SeqCst);
    component.onload(&name).unwrap();
    assert_eq!(card.allocated(), before + component.bytes());
    component.offload().unwrap();
    assert_eq!(card.allocated(), before);
}
