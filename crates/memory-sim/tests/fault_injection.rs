//! Faults injected at every allocation and transfer of a whole Z-Image-Turbo flow on a hard simulated card:
//! every run ends with the fault-free output or a typed error, every component is on a known device, the card
//! holds exactly what the placement says, and the record explains what happened.

use std::sync::Arc;

use memory_sim::{CardSpec, Faults, Mode, PipelineProfile, SimCard, VirtualComponent};
use offload_core::{ComponentsManager, DeviceMemory, Error, Reason};

struct Outcome {
    /// Calls completed per component, in registration order: the flow's "output".
    calls: Vec<u64>,
    error: Option<Error>,
    oom_rows: usize,
}

fn play(card_label: &str, faults: Faults) -> (Outcome, Arc<SimCard>) {
    let profile = PipelineProfile::z_image_turbo(4);
    let card = SimCard::new(CardSpec::parse(card_label).expect("a card size").with_mode(Mode::Hard));
    card.set_faults(faults);
    let manager = ComponentsManager::new();
    let ids: Vec<String> = profile
        .components
        .iter()
        .map(|c| manager.add(&c.name, VirtualComponent::new(c.clone(), card.clone()), None).expect("registers"))
        .collect();
    manager.enable_auto_offload(card.clone(), 3_000_000_000, true).expect("auto offload on");
    let mut error = None;
    for name in profile.uses(2) {
        let index = profile.components.iter().position(|c| c.name == name).expect("a component of the profile");
        if let Err(e) = manager.run(&ids[index], |v: &mut VirtualComponent| v.call()) {
            error = Some(e);
            break;
        }
    }
    // Every component is on a known device, and the card holds its weights and nothing else of theirs.
    let mut resident_weights = 0;
    let mut calls = Vec::new();
    for (id, device) in manager.placement() {
        let (bytes, component_device, n) = manager
            .inspect(&id, |v: &VirtualComponent| (v.profile().bytes, offload_core::Offloadable::device(v), v.calls()))
            .expect("a registered component");
        assert_eq!(device, component_device, "{id}: the manager and the component disagree on its device");
        if !device.is_cpu() {
            resident_weights += bytes;
        }
        calls.push(n);
    }
    assert!(card.allocated() >= resident_weights, "resident weights are allocated on the card");
    let outputs: u64 = profile.components.iter().map(|c| c.activations.left_behind).sum();
    assert!(
        card.allocated() <= resident_weights + outputs,
        "nothing leaked: {} > {}",
        card.allocated(),
        resident_weights + outputs
    );
    let oom_rows =
        manager.offload_record().events().iter().filter(|e| matches!(e.reason, Some(Reason::OomRetry(_)))).count();
    (Outcome { calls, error, oom_rows }, card)
}

#[test]
fn an_out_of_memory_at_every_allocation_point() {
    for card in ["16GB", "24GB", "32GB"] {
        let (clean, probe) = play(card, Faults::default());
        assert!(clean.error.is_none(), "{card}: the fault-free run must complete");
        let points = probe.stats().allocations;
        let (mut recovered, mut typed_errors) = (0, 0);
        for n in 1..=points {
            let (outcome, _) = play(card, Faults { fail_allocation: Some(n), ..Faults::default() });
            match outcome.error {
                None => {
                    assert_eq!(outcome.calls, clean.calls, "{card} fault {n}: output differs");
                    recovered += 1;
                }
                Some(Error::DoesNotFit { ref id, .. }) => {
                    assert!(outcome.error.as_ref().unwrap().to_string().contains("group offloading"));
                    assert!(!id.is_empty());
                    typed_errors += 1;
                }
                Some(other) => panic!("{card} fault {n}: unexpected error {other}"),
            }
            if outcome.error.is_none() && outcome.calls == clean.calls && outcome.oom_rows == 0 {
                // A failure absorbed without a retry is impossible: every injected failure is an OOM.
                panic!("{card} fault {n}: the injected failure left no trace in the record");
            }
        }
        assert_eq!(recovered + typed_errors, points);
        eprintln!(
            "{card}: {points} injection points, {recovered} recovered with equal output, {typed_errors} typed errors"
        );
    }
}

#[test]
fn a_failed_transfer_is_a_typed_error_and_loses_nothing() {
    let (clean, probe) = play("32GB", Faults::default());
    assert!(clean.error.is_none());
    for n in 1..=probe.stats().transfers {
        let (outcome, _) = play("32GB", Faults { fail_transfer: Some(n), ..Faults::default() });
        let error = outcome.error.expect("a failed transfer stops the run");
        assert!(matches!(error, Error::Component { .. }), "{error}");
        assert!(error.to_string().contains("host copy is intact"), "{error}");
    }
}
