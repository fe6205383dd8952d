//! The anchor's `ComponentsManager` test suite, ported: registry, auto offload, OOM retry, the record, and
//! add/remove while enabled, with the same expected decisions and record rows.

mod common;

use std::sync::Arc;

use common::{Dummy, UNIT, hard_card, patched_card};
use expect_test::expect;
use offload_core::{Action, ComponentsManager, DeviceLedger, DeviceName, Error, Lookup, Reason};
use offload_strategy::OffloadView;

/// A second component type, to run a component as the wrong type.
struct NotADummy;

impl offload_core::Offloadable for NotADummy {
    fn bytes(&self) -> u64 {
        0
    }
    fn device(&self) -> DeviceName {
        DeviceName::cpu()
    }
    fn onload(&mut self, _: &DeviceName) -> Result<(), offload_core::ComponentError> {
        Ok(())
    }
    fn offload(&mut self) -> Result<(), offload_core::ComponentError> {
        Ok(())
    }
}

fn device_of(manager: &ComponentsManager, id: &str) -> String {
    manager.component_info(id).expect("a registered component").device.to_string()
}

fn run(manager: &ComponentsManager, id: &str) -> f64 {
    manager.run(id, |m: &mut Dummy| m.forward(1.0, 0)).expect("the call runs")
}

// --- TestComponentsManagerRegistry ---

#[test]
fn add_and_get_one() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let id = manager.add("unet", Dummy::new(4 * UNIT, &card), None).unwrap();
    assert!(manager.ids().contains(&id));
    assert_eq!(manager.get_one(&Lookup::name("unet")).unwrap(), id);
    assert_eq!(manager.get_one(&Lookup::id(&id)).unwrap(), id);
}

#[test]
fn lookups_that_match_none_or_several_are_errors() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let a = manager.add("vae", Dummy::new(UNIT, &card), Some("flux")).unwrap();
    let b = manager.add("vae", Dummy::new(UNIT, &card), Some("sdxl")).unwrap();
    assert!(matches!(manager.get_one(&Lookup::name("unet")), Err(Error::NoMatch { .. })));
    match manager.get_one(&Lookup::name("vae")) {
        Err(Error::MultipleMatches { ids, .. }) => assert_eq!(ids, vec![a.clone(), b.clone()]),
        other => panic!("expected several matches, got {other:?}"),
    }
    assert_eq!(manager.get_one(&Lookup::name("vae").in_collection("sdxl")).unwrap(), b);
    assert!(matches!(manager.get_one(&Lookup::id(&a).in_collection("flux")), Err(Error::AmbiguousLookup { .. })));
    assert!(matches!(manager.get_one(&Lookup::id("nope_9")), Err(Error::UnknownComponent { .. })));
    assert_eq!(manager.collection("flux"), vec![a]);
}

#[test]
fn a_collection_holds_one_component_per_name() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let old = manager.add("vae", Dummy::new(UNIT, &card), Some("flux")).unwrap();
    let new = manager.add("vae", Dummy::new(2 * UNIT, &card), Some("flux")).unwrap();
    assert_ne!(old, new);
    assert_eq!(manager.ids(), vec![new]);
}

#[test]
fn remove_hands_the_component_back_and_a_second_remove_is_an_error() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let id = manager.add("unet", Dummy::new(4 * UNIT, &card), None).unwrap();
    let component = manager.remove(&id).unwrap();
    assert_eq!(component.bytes(), 4 * UNIT);
    assert!(!manager.ids().contains(&id));
    assert!(matches!(manager.remove(&id), Err(Error::UnknownComponent { .. })));
}

#[test]
fn component_info_reports_size_and_class() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let id = manager.add("unet", Dummy::new(4 * UNIT, &card), Some("sd")).unwrap();
    let info = manager.component_info(&id).unwrap();
    assert_eq!(info.bytes, 4 * UNIT);
    assert_eq!(info.class_name, "Dummy");
    assert_eq!(info.collection.as_deref(), Some("sd"));
    assert_eq!(info.execution_device, None);
    assert!(matches!(manager.component_info("x_1"), Err(Error::UnknownComponent { .. })));
}

#[test]
fn invalid_names_and_wrong_types_are_typed_errors_and_move_nothing() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    assert!(matches!(manager.add("", Dummy::new(UNIT, &card), None), Err(Error::InvalidName { .. })));
    assert!(matches!(manager.add("a b", Dummy::new(UNIT, &card), None), Err(Error::InvalidName { .. })));
    let id = manager.add("unet", Dummy::new(UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    let wrong = manager.run(&id, |_: &mut NotADummy| Ok(()));
    assert!(matches!(wrong, Err(Error::WrongType { .. })), "{wrong:?}");
    assert_eq!(device_of(&manager, &id), "cpu");
    assert!(manager.offload_record().is_empty());
}

#[test]
fn summary_lists_components() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    manager.add("text_encoder", Dummy::new(8 * UNIT, &card), None).unwrap();
    manager.add("vae", Dummy::new(UNIT + UNIT / 2, &card), Some("flux")).unwrap();
    manager.enable_auto_offload(card.clone(), 3 * UNIT, true).unwrap();
    expect![[r#"
        Components:
        =============================================================================
        Name_ID        | Class | Device: act(exec) | Size    | Offload   | Collection
        text_encoder_1 | Dummy | cpu(cuda:0)       | 8.00 KB | component | -
        vae_2          | Dummy | cpu(cuda:0)       | 1.50 KB | component | flux
        auto offload: on cuda:0 with 3.00 KB reserved, strategy auto, OOM retry on"#]]
    .assert_eq(&manager.to_string());
}

// --- TestAutoOffload (patched readings) ---

#[test]
fn auto_offload_starts_with_all_components_on_cpu() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let mut on_device = Dummy::new(4 * UNIT, &card);
    on_device.device = DeviceName::parse("cuda").unwrap();
    let id = manager.add("m", on_device, None).unwrap();
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    assert_eq!(device_of(&manager, &id), "cpu");
}

#[test]
fn offloads_resident_model_under_memory_pressure() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let m1 = manager.add("m1", Dummy::new(4 * UNIT, &card), None).unwrap();
    let m2 = manager.add("m2", Dummy::new(4 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    run(&manager, &m1);
    assert_eq!(device_of(&manager, &m1), "cuda:0");
    card.patch_available(Some(4 * UNIT));
    run(&manager, &m2);
    assert_eq!(device_of(&manager, &m2), "cuda:0");
    assert_eq!(device_of(&manager, &m1), "cpu");
    card.patch_available(Some(70 * UNIT));
    run(&manager, &m1);
    assert_eq!(device_of(&manager, &m1), "cuda:0");
    assert_eq!(device_of(&manager, &m2), "cuda:0");
    manager.disable_auto_offload().unwrap();
    assert_eq!(device_of(&manager, &m1), "cpu");
    assert_eq!(device_of(&manager, &m2), "cpu");
}

#[test]
fn set_offload_strategy_replaces_the_decisions() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let m1 = manager.add("m1", Dummy::new(4 * UNIT, &card), None).unwrap();
    let m2 = manager.add("m2", Dummy::new(4 * UNIT, &card), None).unwrap();
    let everything = |view: &OffloadView<'_>| view.candidates().map(|r| r.id().to_string()).collect::<Vec<_>>();
    let before = manager.set_offload_strategy(Arc::new(everything));
    assert!(matches!(before, Err(Error::NotEnabled)));
    assert!(before.unwrap_err().to_string().contains("not enabled"));
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    manager.set_offload_strategy(Arc::new(everything)).unwrap();
    run(&manager, &m1);
    run(&manager, &m2);
    assert_eq!(device_of(&manager, &m2), "cuda:0");
    assert_eq!(device_of(&manager, &m1), "cpu");
}

#[test]
fn a_strategy_that_chooses_a_protected_component_is_refused() {
    let card = patched_card(4 * UNIT);
    let manager = ComponentsManager::new();
    let m1 = manager.add("m1", Dummy::new(4 * UNIT, &card), None).unwrap();
    let m2 = manager.add("m2", Dummy::new(4 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    manager.set_offload_strategy(Arc::new(|_: &OffloadView<'_>| vec!["ghost_7".to_string()])).unwrap();
    run(&manager, &m1);
    let refused = manager.run(&m2, |m: &mut Dummy| m.forward(1.0, 0));
    assert!(matches!(refused, Err(Error::InvalidDecision { .. })), "{refused:?}");
    assert_eq!(device_of(&manager, &m2), "cpu");
    assert_eq!(device_of(&manager, &m1), "cuda:0");
}

#[test]
fn record_captures_what_the_strategy_saw() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let m1 = manager.add("m1", Dummy::new(4 * UNIT, &card), None).unwrap();
    let m2 = manager.add("m2", Dummy::new(4 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    run(&manager, &m1);
    card.patch_available(Some(4 * UNIT));
    run(&manager, &m2);
    let events = manager.offload_record().events();
    assert_eq!(events.len(), 3);
    assert_eq!((events[0].action, events[0].id.as_str(), events[0].bytes), (Action::Onload, m1.as_str(), 4 * UNIT));
    assert_eq!((events[0].available, events[0].reason.clone()), (Some(70 * UNIT), None));
    assert_eq!((events[1].action, events[1].id.as_str()), (Action::Offload, m1.as_str()));
    assert_eq!(events[1].reason, Some(Reason::ReleaseMemoryFor(m2.clone())));
    assert_eq!(events[1].available, Some(4 * UNIT));
    assert_eq!(
        (events[2].action, events[2].id.as_str(), events[2].available),
        (Action::Onload, m2.as_str(), Some(4 * UNIT))
    );
    manager.disable_auto_offload().unwrap();
    let events = manager.offload_record().events();
    assert_eq!(events.len(), 4);
    assert_eq!((events[3].id.as_str(), events[3].reason.clone()), (m2.as_str(), Some(Reason::OffloadingDisabled)));
    assert!(events[3].available.is_some());
    let peaks: Vec<u64> = events.iter().map(|e| e.peak.unwrap()).collect();
    assert!(peaks.windows(2).all(|w| w[0] <= w[1]), "{peaks:?}");
    let table = manager.offload_record().to_string();
    let row = table.lines().find(|l| l.starts_with("2 ")).unwrap();
    assert!(row.contains(&m1) && row.contains(&m2), "{row}");
    expect![[r#"
        # | Onload         | Offloaded      | Available | Peak    | Reason
        ------------------------------------------------------------------
        1 | m1_1 (4.00 KB) | -              | 70.00 KB  | 0 B     |
        2 | m2_2 (4.00 KB) | m1_1 (4.00 KB) | 4.00 KB   | 4.00 KB |
        3 | -              | m2_2 (4.00 KB) | 4.00 KB   | 4.00 KB | offloading_disabled"#]]
    .assert_eq(&table);
}

#[test]
fn enable_twice_is_idempotent() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let m1 = manager.add("m1", Dummy::new(4 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    run(&manager, &m1);
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    assert_eq!(device_of(&manager, &m1), "cpu");
    assert!(manager.offload_record().is_empty());
    assert_eq!(run(&manager, &m1), 1.0 + 4.0 * UNIT as f64 / 7.0);
    assert_eq!(device_of(&manager, &m1), "cuda:0");
    assert_eq!(manager.offload_record().len(), 1);
}

#[test]
fn add_model_after_a_run_keeps_residents_in_place() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let m1 = manager.add("m1", Dummy::new(4 * UNIT, &card), None).unwrap();
    let m2 = manager.add("m2", Dummy::new(4 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    run(&manager, &m1);
    run(&manager, &m2);
    let m3 = manager.add("m3", Dummy::new(4 * UNIT, &card), None).unwrap();
    assert_eq!(device_of(&manager, &m1), "cuda:0");
    assert_eq!(device_of(&manager, &m2), "cuda:0");
    assert_eq!(device_of(&manager, &m3), "cpu");
    run(&manager, &m3);
    for id in [&m1, &m2, &m3] {
        assert_eq!(device_of(&manager, id), "cuda:0");
    }
}

#[test]
fn added_model_can_displace_residents_under_pressure() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let m1 = manager.add("m1", Dummy::new(4 * UNIT, &card), None).unwrap();
    let m2 = manager.add("m2", Dummy::new(4 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    run(&manager, &m1);
    run(&manager, &m2);
    let m3 = manager.add("m3", Dummy::new(4 * UNIT, &card), None).unwrap();
    card.patch_available(Some(4 * UNIT));
    run(&manager, &m3);
    assert_eq!(device_of(&manager, &m3), "cuda:0");
    assert_eq!(device_of(&manager, &m1), "cpu", "sizes are equal: the first added goes");
    assert_eq!(device_of(&manager, &m2), "cuda:0");
}

#[test]
fn remove_model_after_a_run_leaves_others_resident() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let m1 = manager.add("m1", Dummy::new(4 * UNIT, &card), None).unwrap();
    let m2 = manager.add("m2", Dummy::new(4 * UNIT, &card), None).unwrap();
    let m3 = manager.add("m3", Dummy::new(4 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), UNIT, true).unwrap();
    for id in [&m1, &m2, &m3] {
        run(&manager, id);
    }
    let removed = manager.remove(&m2).unwrap();
    assert!(removed.device().is_cpu());
    assert_eq!(device_of(&manager, &m1), "cuda:0");
    assert_eq!(device_of(&manager, &m3), "cuda:0");
    assert_eq!(run(&manager, &m1), 1.0 + 4.0 * UNIT as f64 / 7.0);
}

// --- OOM retry (hard readings) ---

/// The anchor's setup scaled to units: a 32-unit model, a 64-unit resident, a 40-unit output, 120 units free.
#[test]
fn oom_retry_offloads_a_resident_model_and_reruns() {
    let card = hard_card(120 * UNIT);
    let manager = ComponentsManager::new();
    let model = manager.add("model", Dummy::new(32 * UNIT, &card), None).unwrap();
    let resident = manager.add("resident", Dummy::new(64 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    manager.run(&resident, |m: &mut Dummy| m.forward(0.0, 0)).unwrap();
    let baseline = 3.0 + 32.0 * UNIT as f64 / 7.0;
    let out = manager.run(&model, |m: &mut Dummy| m.forward(3.0, 40 * UNIT)).unwrap();
    assert_eq!(out, baseline);
    assert_eq!(device_of(&manager, &resident), "cpu");
    assert_eq!(device_of(&manager, &model), "cuda:0");
    let last = manager.offload_record().events().pop().unwrap();
    assert_eq!((last.action, last.id.clone()), (Action::Offload, resident.clone()));
    assert_eq!(last.reason, Some(Reason::OomRetry(model.clone())));
    // The output allocation failed, not the onload: the re-run needed no second onload.
    assert_eq!(manager.inspect(&model, |m: &Dummy| m.onloads).unwrap(), 1);
}

#[test]
fn oom_reraises_with_advice_when_nothing_is_left_to_offload() {
    let card = hard_card(64 * UNIT);
    let manager = ComponentsManager::new();
    let model = manager.add("model", Dummy::new(32 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    let err = manager.run(&model, |m: &mut Dummy| m.forward(1.0, 48 * UNIT)).unwrap_err();
    assert!(matches!(err, Error::DoesNotFit { .. }), "{err:?}");
    assert!(err.to_string().contains("group offloading"), "{err}");
    // Nothing lost: the component is still registered, on a known device, and runs with a smaller output.
    assert_eq!(device_of(&manager, &model), "cuda:0");
    assert!(manager.run(&model, |m: &mut Dummy| m.forward(1.0, 8 * UNIT)).is_ok());
}

/// A model under group offload as the manager sees it: never evicted, 16 units resident, and `idle` units its
/// prefetch worker uploaded for its next call, which it gives back when asked.
struct Streamer {
    card: Arc<memory_sim::SimCard>,
    device: DeviceName,
    idle: u64,
}

impl offload_core::Offloadable for Streamer {
    fn bytes(&self) -> u64 {
        64 * UNIT
    }
    fn device(&self) -> DeviceName {
        self.device.clone()
    }
    fn onload(&mut self, device: &DeviceName) -> Result<(), offload_core::ComponentError> {
        self.card.allocate(16 * UNIT + self.idle)?;
        self.device = device.clone();
        Ok(())
    }
    fn offload(&mut self) -> Result<(), offload_core::ComponentError> {
        self.card.free(16 * UNIT + self.idle);
        self.idle = 0;
        self.device = DeviceName::cpu();
        Ok(())
    }
    fn resident_bytes(&self) -> u64 {
        16 * UNIT
    }
    fn evictable(&self) -> bool {
        false
    }
    fn release_idle(&mut self) -> u64 {
        self.card.free(self.idle);
        std::mem::take(&mut self.idle)
    }
}

/// A component that runs out of memory with nothing evictable left first gets what the components under group
/// offload hold only for their next call (their idle prefetches), then runs; with nothing idle it does not fit.
#[test]
fn oom_retry_takes_back_idle_prefetches_before_it_gives_up() {
    let card = hard_card(100 * UNIT);
    let manager = ComponentsManager::new();
    let streamer = Streamer { card: card.clone(), device: DeviceName::cpu(), idle: 40 * UNIT };
    let streamer = manager.add("transformer", streamer, None).unwrap();
    let decoder = manager.add("decoder", Dummy::new(32 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    manager.run(&streamer, |_: &mut Streamer| Ok(())).unwrap();
    // 56 units held (16 resident, 40 idle), 32 for the decoder's weights: its 40-unit output does not fit until
    // the idle 40 go back.
    assert_eq!(run_decode(&manager, &decoder, 40 * UNIT), Ok(2.0 + 32.0 * UNIT as f64 / 7.0));
    assert_eq!(device_of(&manager, &streamer), "cuda:0", "never evicted");
    assert_eq!(manager.inspect(&streamer, |s: &Streamer| s.idle).unwrap(), 0, "its idle prefetches went back");
    // Nothing idle is left: an output that the resident 16 units leave no room for does not fit, typed.
    let err = manager.run(&decoder, |m: &mut Dummy| m.decode(1.0, 60 * UNIT)).unwrap_err();
    assert!(matches!(err, Error::DoesNotFit { .. }), "{err:?}");
}

/// A component under group offload that runs out of memory in its own call, with nothing of the others left to
/// give, gets back what it holds only for its next call (its idle prefetches, which the prefetch worker may have
/// uploaded while the call ran) and runs once more; it gives them back once per run, so a call that fills the
/// room again each time it runs ends typed, as [`Error::DoesNotFit`], after two tries, never in a loop.
#[test]
fn a_call_that_runs_out_gives_back_its_own_idle_prefetches_once_and_runs_again() {
    let card = hard_card(100 * UNIT);
    let manager = ComponentsManager::new();
    let streamer = Streamer { card: card.clone(), device: DeviceName::cpu(), idle: 40 * UNIT };
    let streamer = manager.add("transformer", streamer, None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    // 56 units held (16 resident, 40 idle): a call that needs 50 fits only once the idle 40 go back.
    let mut tries = 0;
    let call = |s: &mut Streamer, tries: &mut u32, need: u64| {
        *tries += 1;
        s.card.allocate(need)?;
        s.card.free(need);
        Ok(())
    };
    manager.run(&streamer, |s: &mut Streamer| call(s, &mut tries, 50 * UNIT)).unwrap();
    assert_eq!(tries, 2, "one failed call, then one after its idle prefetches went back");
    assert_eq!(manager.inspect(&streamer, |s: &Streamer| s.idle).unwrap(), 0, "its idle prefetches went back");
    let reasons: Vec<String> =
        manager.offload_record().events().iter().filter_map(|e| e.reason.as_ref().map(ToString::to_string)).collect();
    assert!(reasons.is_empty(), "nothing evicted: {reasons:?}");
    // Each try prefetches 40 units for the next call before it asks for 50 more: the room is gone again every
    // time, so the second try's failure is the verdict.
    let mut tries = 0;
    let err = manager
        .run(&streamer, |s: &mut Streamer| {
            s.card.allocate(40 * UNIT)?;
            s.idle += 40 * UNIT;
            call(s, &mut tries, 50 * UNIT)
        })
        .unwrap_err();
    assert!(matches!(err, Error::DoesNotFit { .. }), "{err:?}");
    assert_eq!(tries, 2, "its own idle prefetches go back once per run");
    assert_eq!(device_of(&manager, &streamer), "cuda:0", "never evicted");
}

fn run_decode(manager: &ComponentsManager, id: &str, output: u64) -> Result<f64, String> {
    manager.run(id, |m: &mut Dummy| m.decode(1.0, output)).map_err(|e| e.to_string())
}

#[test]
fn oom_retry_covers_other_entry_points() {
    let card = hard_card(120 * UNIT);
    let manager = ComponentsManager::new();
    let decoder = manager.add("decoder", Dummy::new(32 * UNIT, &card), None).unwrap();
    let resident = manager.add("resident", Dummy::new(64 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    manager.run(&resident, |m: &mut Dummy| m.forward(0.0, 0)).unwrap();
    let out = manager.run(&decoder, |m: &mut Dummy| m.decode(1.0, 40 * UNIT)).unwrap();
    assert_eq!(out, 2.0 + 32.0 * UNIT as f64 / 7.0);
    assert_eq!(device_of(&manager, &resident), "cpu");
    assert_eq!(device_of(&manager, &decoder), "cuda:0");
}

#[test]
fn oom_during_onload_is_retried_too() {
    let card = hard_card(100 * UNIT);
    let manager = ComponentsManager::new();
    let a = manager.add("a", Dummy::new(60 * UNIT, &card), None).unwrap();
    let b = manager.add("b", Dummy::new(50 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    // A strategy that never offloads: the onload of b runs out of memory and the retry makes room.
    manager.set_offload_strategy(Arc::new(|_: &OffloadView<'_>| Vec::new())).unwrap();
    manager.run(&a, |m: &mut Dummy| m.forward(0.0, 0)).unwrap();
    manager.run(&b, |m: &mut Dummy| m.forward(0.0, 0)).unwrap();
    assert_eq!(device_of(&manager, &a), "cpu");
    assert_eq!(device_of(&manager, &b), "cuda:0");
    let reasons: Vec<String> =
        manager.offload_record().events().iter().filter_map(|e| e.reason.as_ref().map(ToString::to_string)).collect();
    assert_eq!(reasons, vec![format!("oom_retry:{b}")]);
}

#[test]
fn oom_without_retry_is_returned_as_is() {
    let card = hard_card(120 * UNIT);
    let manager = ComponentsManager::new();
    let model = manager.add("model", Dummy::new(32 * UNIT, &card), None).unwrap();
    let resident = manager.add("resident", Dummy::new(64 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, false).unwrap();
    manager.run(&resident, |m: &mut Dummy| m.forward(0.0, 0)).unwrap();
    let err = manager.run(&model, |m: &mut Dummy| m.forward(3.0, 40 * UNIT)).unwrap_err();
    assert!(matches!(err, Error::Component { operation: "run", .. }), "{err:?}");
    assert_eq!(device_of(&manager, &resident), "cuda:0");
}

/// Serialised < partial < all resident, the anchor's peak ordering, on cards sized for each regime.
#[test]
fn offloading_reduces_peak_memory() {
    let peak_on = |capacity: Option<u64>| {
        let card = hard_card(capacity.unwrap_or(1 << 40));
        let manager = ComponentsManager::new();
        let ids: Vec<String> =
            ["a", "b", "c"].iter().map(|n| manager.add(n, Dummy::new(64 * UNIT, &card), None).unwrap()).collect();
        manager.enable_auto_offload(card.clone(), 0, true).unwrap();
        for id in &ids {
            manager.run(id, |m: &mut Dummy| m.forward(0.0, 8 * UNIT)).unwrap();
        }
        manager.disable_auto_offload().unwrap();
        offload_core::DeviceMemory::peak(card.as_ref())
    };
    let serialised = peak_on(Some(80 * UNIT));
    let partial = peak_on(Some(160 * UNIT));
    let resident = peak_on(None);
    assert!(serialised < partial && partial < resident, "{serialised} {partial} {resident}");
}

/// Readings of the host itself: what a user passes when the execution device is the CPU.
struct HostReadings;

impl offload_core::DeviceMemory for HostReadings {
    fn device(&self) -> DeviceName {
        DeviceName::cpu()
    }
    fn total(&self) -> u64 {
        64 * UNIT
    }
    fn available(&self) -> u64 {
        64 * UNIT
    }
    fn allocated(&self) -> u64 {
        0
    }
    fn peak(&self) -> u64 {
        0
    }
}

#[test]
fn auto_offload_onto_the_host_is_refused_and_nothing_moves() {
    // diffusers raises here too: with the host as the execution device there is nothing to offload to.
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let id = manager.add("unet", Dummy::new(4 * UNIT, &card), None).unwrap();
    let error = manager.enable_auto_offload(Arc::new(HostReadings), UNIT, true).expect_err("the host is refused");
    assert!(matches!(&error, Error::HostExecution { device } if device.is_cpu()), "{error:?}");
    assert!(error.to_string().contains("nothing to offload to"), "{error}");
    assert!(manager.auto_offload().is_none());
    assert_eq!(device_of(&manager, &id), "cpu");
    assert_eq!(manager.offload_record().events().len(), 0);
}

/// The manager keeps the schedule of uses a lookahead strategy replays: one name per run, an OOM re-run
/// counted once, cleared by a new enable.
#[test]
fn the_schedule_of_uses_is_kept_by_name() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let encoder = manager.add("text_encoder", Dummy::new(4 * UNIT, &card), None).unwrap();
    let denoiser = manager.add("transformer", Dummy::new(4 * UNIT, &card), None).unwrap();
    assert!(manager.uses().is_empty(), "nothing is kept while disabled");
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    for id in [&encoder, &denoiser, &denoiser] {
        run(&manager, id);
    }
    assert_eq!(manager.uses(), ["text_encoder", "transformer", "transformer"]);
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    assert!(manager.uses().is_empty(), "a new session starts a new schedule");
}

/// The schedule keeps every use in order, however the components alternate, and a run refused for its type is
/// no use and leaves no claim behind.
#[test]
fn the_schedule_keeps_alternating_uses_and_a_refused_run_counts_none() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let encoder = manager.add("text_encoder", Dummy::new(4 * UNIT, &card), None).unwrap();
    let denoiser = manager.add("transformer", Dummy::new(4 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    for id in [&encoder, &denoiser, &denoiser, &encoder, &denoiser] {
        run(&manager, id);
    }
    let wrong = manager.run(&denoiser, |_: &mut NotADummy| Ok(()));
    assert!(matches!(wrong, Err(Error::WrongType { .. })), "{wrong:?}");
    assert_eq!(manager.uses(), ["text_encoder", "transformer", "transformer", "text_encoder", "transformer"]);
    manager.disable_auto_offload().unwrap();
    assert!(manager.remove(&denoiser).is_ok(), "no claim was left by the refused run");
}

/// Runs from several threads at once, on the same component and on others: each is one use, and when they are
/// done no claim is left (every component can be removed) and the record's moves add up to the placement.
#[test]
fn runs_from_several_threads_each_count_one_use_and_release_their_claim() {
    let card = patched_card(70 * UNIT);
    let manager = ComponentsManager::new();
    let ids: Vec<String> = ["text_encoder", "transformer", "vae"]
        .iter()
        .map(|n| manager.add(n, Dummy::new(4 * UNIT, &card), None).unwrap())
        .collect();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    const RUNS: usize = 200;
    std::thread::scope(|scope| {
        for thread in 0..4 {
            let (manager, ids) = (&manager, &ids);
            scope.spawn(move || {
                for i in 0..RUNS {
                    run(manager, &ids[(thread + i) % ids.len()]);
                }
            });
        }
    });
    assert_eq!(manager.uses().len(), 4 * RUNS);
    let onloads = manager.offload_record().events().iter().filter(|e| e.action == Action::Onload).count();
    assert_eq!(onloads, ids.len(), "each component onloaded once: nothing was under pressure");
    manager.disable_auto_offload().unwrap();
    for id in &ids {
        assert!(manager.remove(id).is_ok(), "{id} has no claim left");
    }
}

// --- The timeline ---

#[test]
fn the_timeline_holds_each_run_onload_and_offload_with_memory_samples_around_each_move() {
    use offload_core::Timeline;
    use offload_core::timeline::{ArgValue, EventKind, category};

    let card = hard_card(10 * UNIT);
    let manager = ComponentsManager::new();
    let a = manager.add("text_encoder", Dummy::new(6 * UNIT, &card), None).unwrap();
    let b = manager.add("transformer", Dummy::new(6 * UNIT, &card), None).unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();
    // Nothing is recorded before a timeline is set.
    run(&manager, &a);
    assert!(manager.timeline().events().is_empty());
    manager.disable_auto_offload().unwrap();
    manager.enable_auto_offload(card.clone(), 0, true).unwrap();

    let timeline = Timeline::enabled();
    manager.set_timeline(timeline.clone());
    run(&manager, &a);
    run(&manager, &b);
    let spans: Vec<(String, String, Option<ArgValue>)> = timeline
        .events()
        .into_iter()
        .filter(|e| matches!(e.kind, EventKind::Span { .. }))
        .map(|e| (e.category.clone(), e.name.clone(), e.arg("reason").cloned()))
        .collect();
    let reason = ArgValue::Text(format!("release_memory_for:{b}"));
    // Spans are recorded as they end: a move inside its run comes first.
    assert_eq!(
        spans,
        vec![
            (category::ONLOAD.to_string(), a.clone(), None),
            (category::RUN.to_string(), a.clone(), None),
            (category::OFFLOAD.to_string(), a.clone(), Some(reason)),
            (category::ONLOAD.to_string(), b.clone(), None),
            (category::RUN.to_string(), b.clone(), None),
        ]
    );
    let allocated: Vec<u64> = timeline.memory_samples().iter().map(|s| s.allocated).collect();
    assert_eq!(allocated, [0, 6 * UNIT, 6 * UNIT, 0, 0, 6 * UNIT], "before and after each of the three moves");
    assert!(timeline.events().iter().all(|e| e.thread == 1), "all on the test's thread");
}

/// A model under group offload whose call streams a window: 16 units resident, a window of its 24 largest units
/// streamed, of which it keeps 12 on the card after each call (its next call's first group, prefetched). A call
/// charges 8 units of activations, then asks the card for the rest of its window; a refusal there is a refused
/// prefetch (counted, never an error), as group offload's worker sees it.
struct Windowed {
    card: Arc<memory_sim::SimCard>,
    device: DeviceName,
    /// Window units held now (prefetched at the end of the last call).
    held: u64,
    refused: u64,
}

impl Windowed {
    const RESIDENT: u64 = 16 * UNIT;
    const WINDOW: u64 = 24 * UNIT;
    const KEPT: u64 = 12 * UNIT;
    const ACTIVATIONS: u64 = 8 * UNIT;

    fn new(card: &Arc<memory_sim::SimCard>) -> Self {
        Self { card: card.clone(), device: DeviceName::cpu(), held: 0, refused: 0 }
    }

    fn call(&mut self) -> Result<(), offload_core::ComponentError> {
        self.card.allocate(Self::ACTIVATIONS)?;
        let rest = Self::WINDOW - self.held;
        match self.card.allocate(rest) {
            Ok(()) => self.held = Self::WINDOW,
            Err(_) => self.refused += 1,
        }
        self.card.free(Self::ACTIVATIONS);
        // The window goes back but for the next call's first group.
        let kept = self.held.min(Self::KEPT);
        self.card.free(self.held - kept);
        self.held = kept;
        Ok(())
    }
}

impl offload_core::Offloadable for Windowed {
    fn bytes(&self) -> u64 {
        64 * UNIT
    }
    fn device(&self) -> DeviceName {
        self.device.clone()
    }
    fn onload(&mut self, device: &DeviceName) -> Result<(), offload_core::ComponentError> {
        self.card.allocate(Self::RESIDENT)?;
        self.device = device.clone();
        Ok(())
    }
    fn offload(&mut self) -> Result<(), offload_core::ComponentError> {
        self.card.free(Self::RESIDENT + std::mem::take(&mut self.held));
        self.device = DeviceName::cpu();
        Ok(())
    }
    fn resident_bytes(&self) -> u64 {
        Self::RESIDENT
    }
    fn window_bytes(&self) -> u64 {
        Self::WINDOW - self.held
    }
    fn evictable(&self) -> bool {
        false
    }
}

/// Issue 37 in the manager's terms: a component onloaded beside a streamed model that holds its next call's first
/// group (image 2's encoder) used to stay while the streamed model ran, whose window then did not fit: a refused
/// prefetch per call, seen nowhere but in its counters. Before each run of a streamed model the manager now checks
/// its window beside the reserve, and asks the strategy to make room when it does not fit, on the same decision
/// path as an onload: the encoder leaves, recorded as `release_memory_for:<the model>` in a row of its own.
#[test]
fn a_streamed_models_window_makes_room_before_it_runs_and_the_record_says_why() {
    let card = hard_card(100 * UNIT);
    let manager = ComponentsManager::new();
    let encoder = manager.add("encoder", Dummy::new(60 * UNIT, &card), None).unwrap();
    let streamed = manager.add("unet", Windowed::new(&card), None).unwrap();
    manager.enable_auto_offload(card.clone(), Windowed::ACTIVATIONS, true).unwrap();
    for _image in 0..3 {
        run(&manager, &encoder);
        for _step in 0..2 {
            manager.run(&streamed, Windowed::call).unwrap();
        }
    }
    assert_eq!(manager.inspect(&streamed, |w: &Windowed| w.refused).unwrap(), 0, "no prefetch refused");
    assert!(offload_core::DeviceMemory::peak(card.as_ref()) <= 100 * UNIT);
    // Image 1: the onload counts the window too (16 + 24 units beside the 8 reserved do not fit the 40 left), so
    // the encoder leaves for the streamed model's onload. Images 2 and 3: the encoder comes back beside the
    // streamed model and its 12 prefetched units, and leaves again when the window's other 12 do not fit.
    expect![[r#"
        # | Onload               | Offloaded            | Available | Peak     | Reason
        -------------------------------------------------------------------------------
        1 | encoder_1 (60.00 KB) | -                    | 100.00 KB | 0 B      |
        2 | unet_2 (16.00 KB)    | encoder_1 (60.00 KB) | 40.00 KB  | 60.00 KB |
        3 | encoder_1 (60.00 KB) | -                    | 72.00 KB  | 60.00 KB |
        4 | -                    | encoder_1 (60.00 KB) | 12.00 KB  | 88.00 KB | release_memory_for:unet_2
        5 | encoder_1 (60.00 KB) | -                    | 72.00 KB  | 88.00 KB |
        6 | -                    | encoder_1 (60.00 KB) | 12.00 KB  | 88.00 KB | release_memory_for:unet_2"#]]
    .assert_eq(&manager.offload_record().to_string());
}

/// A window that fits beside the reserve moves nothing, and the strategy is not asked: a streamed model's check
/// costs a reading, not a decision.
#[test]
fn a_window_that_fits_moves_nothing_and_asks_no_strategy() {
    let card = hard_card(200 * UNIT);
    let manager = ComponentsManager::new();
    let encoder = manager.add("encoder", Dummy::new(60 * UNIT, &card), None).unwrap();
    let streamed = manager.add("unet", Windowed::new(&card), None).unwrap();
    manager.enable_auto_offload(card.clone(), Windowed::ACTIVATIONS, true).unwrap();
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = asked.clone();
    let strategy = move |_: &OffloadView<'_>| {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Vec::new()
    };
    manager.set_offload_strategy(Arc::new(strategy)).unwrap();
    for _image in 0..2 {
        run(&manager, &encoder);
        manager.run(&streamed, Windowed::call).unwrap();
        manager.run(&streamed, Windowed::call).unwrap();
    }
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1, "asked once, when the streamed model came");
    assert_eq!(device_of(&manager, &encoder), "cuda:0", "the encoder stayed");
    let offloads = manager.offload_record().events().iter().filter(|e| e.action == Action::Offload).count();
    assert_eq!(offloads, 0);
}
