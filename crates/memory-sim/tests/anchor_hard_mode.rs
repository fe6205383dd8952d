//! The anchor's hard-mode scenarios (`TestAutoOffload` in diffusers PR #14304) on the simulated card: OOM
//! retry, re-raise with advice, a second entry point, and the peak ordering of serialised, partial and
//! all-resident runs.

use std::sync::Arc;

use memory_sim::{ActivationProfile, CardSpec, ComponentProfile, Mode, SimCard, VirtualComponent};
use offload_core::{Action, ComponentsManager, DeviceLedger, DeviceMemory, Error, Reason};

const UNIT: u64 = 1 << 20;

fn card(headroom_units: u64) -> Arc<SimCard> {
    let spec = CardSpec::parse(&(headroom_units * UNIT).to_string())
        .expect("a card size")
        .with_mode(Mode::Hard)
        .with_context_overhead(0);
    SimCard::new(spec)
}

fn component(name: &str, units: u64, working_units: u64, card: &Arc<SimCard>) -> VirtualComponent {
    let profile = ComponentProfile {
        name: name.into(),
        bytes: units * UNIT,
        activations: ActivationProfile::new(working_units * UNIT, 0),
        flops: 1e9,
    };
    VirtualComponent::new(profile, card.clone())
}

fn device_of(manager: &ComponentsManager, id: &str) -> String {
    manager.component_info(id).expect("a registered component").device.kind().to_string()
}

#[test]
fn oom_retry_offloads_a_resident_component_and_reruns() {
    let card = card(120);
    let manager = ComponentsManager::new();
    let model = manager.add("model", component("model", 32, 40, &card), None).unwrap();
    let resident = manager.add("resident", component("resident", 64, 0, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    manager.run(&resident, |v: &mut VirtualComponent| v.call()).unwrap();
    // 64 + 32 + 40 > 120: the model's working set fails, the resident goes, the call runs again.
    let output = manager.run(&model, |v: &mut VirtualComponent| v.call()).unwrap();
    assert_eq!(output, 1, "the re-run is the model's first completed call, from the same inputs");
    assert_eq!(device_of(&manager, &resident), "cpu");
    assert_eq!(device_of(&manager, &model), "cuda");
    let last = manager.offload_record().events().pop().unwrap();
    assert_eq!((last.action, last.id.as_str()), (Action::Offload, resident.as_str()));
    assert_eq!(last.reason, Some(Reason::OomRetry(model.clone())));
}

#[test]
fn oom_reraises_with_advice_when_nothing_is_left() {
    let card = card(64);
    let manager = ComponentsManager::new();
    let model = manager.add("model", component("model", 32, 48, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    let error = manager.run(&model, |v: &mut VirtualComponent| v.call()).unwrap_err();
    assert!(matches!(error, Error::DoesNotFit { .. }), "{error}");
    assert!(error.to_string().contains("group offloading"), "{error}");
    assert_eq!(card.allocated(), 32 * UNIT, "the weights stay, the failed working set is not held");
}

#[test]
fn oom_retry_covers_a_second_entry_point() {
    let card = card(120);
    let manager = ComponentsManager::new();
    let vae = manager.add("vae", component("vae", 32, 0, &card), None).unwrap();
    let resident = manager.add("resident", component("resident", 64, 0, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    manager.run(&resident, |v: &mut VirtualComponent| v.call()).unwrap();
    // A decode that needs 40 units beside the weights: any closure is an entry point.
    let ledger = card.clone();
    let decoded = manager
        .run(&vae, |_: &mut VirtualComponent| {
            ledger.allocate(40 * UNIT)?;
            ledger.free(40 * UNIT);
            Ok("decoded")
        })
        .unwrap();
    assert_eq!(decoded, "decoded");
    assert_eq!(device_of(&manager, &resident), "cpu");
    assert_eq!(device_of(&manager, &vae), "cuda");
}

#[test]
fn offloading_reduces_peak_memory() {
    let peak_on = |units: u64| {
        let card = card(units);
        let manager = ComponentsManager::new();
        let ids: Vec<String> =
            ["a", "b", "c"].iter().map(|n| manager.add(n, component(n, 64, 8, &card), None).unwrap()).collect();
        manager.enable_auto_offload(card.clone(), 0, true).unwrap();
        for id in &ids {
            manager.run(id, |v: &mut VirtualComponent| v.call()).unwrap();
        }
        card.peak()
    };
    let (serialised, partial, resident) = (peak_on(80), peak_on(160), peak_on(1 << 20));
    assert!(serialised < partial && partial < resident, "{serialised} < {partial} < {resident}");
}

/// A call's activations are a sequence of allocations: the OOM strikes part-way, and the `oom_retry` row reads
/// the memory the failed call still held (a peak above the weights, less available than the weights leave).
#[test]
fn an_oom_part_way_through_a_call_shows_in_the_retry_rows_readings() {
    let card = card(120);
    let manager = ComponentsManager::new();
    let mut model = component("model", 32, 40, &card);
    let profile = ActivationProfile::new(40 * UNIT, 0).in_allocations(4);
    model = VirtualComponent::new(ComponentProfile { activations: profile, ..model.profile().clone() }, card.clone());
    let model = manager.add("model", model, None).unwrap();
    let resident = manager.add("resident", component("resident", 64, 0, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    manager.run(&resident, |v: &mut VirtualComponent| v.call()).unwrap();
    // 64 + 32 weights leave 24 units: two 10-unit parts fit, the third fails with 20 units held.
    manager.run(&model, |v: &mut VirtualComponent| v.call()).unwrap();
    let retry = manager.offload_record().events().pop().unwrap();
    assert_eq!(retry.reason, Some(Reason::OomRetry(model.clone())));
    assert_eq!(retry.available, Some(4 * UNIT), "24 units the weights leave, less the 20 the failed call holds");
    assert_eq!(retry.peak, Some(116 * UNIT), "the weights' 96 units and the failed call's 20");
    // Released before the re-run: the re-run's peak is the model's weights and its whole working set.
    assert_eq!(card.allocated(), 32 * UNIT);
    assert_eq!(card.peak(), 116 * UNIT);
}

#[test]
fn the_working_set_splits_into_its_allocations() {
    let parts: Vec<u64> = ActivationProfile::new(10, 0).in_allocations(4).parts().collect();
    assert_eq!(parts, [2, 2, 2, 4]);
    assert_eq!(ActivationProfile::new(7, 1).in_allocations(0).parts().collect::<Vec<_>>(), [7]);
}
