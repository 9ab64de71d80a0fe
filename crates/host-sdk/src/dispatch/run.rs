//! One dispatch, in the contract's order: map the agent state, check the event, filter per phone,
//! learn what the gateway takes, suppress bursts, batch and send.

use std::collections::HashSet;

use orca_push_api::{DELIVERY_PROTOCOL_WITH_KIND, Kind};

use super::failures::Tally;
use super::select::{self, Mapped};
use super::send::batches;
use super::{DispatchEvent, DispatchReport, Inner, Skip};
use crate::{Gateway, Registration, RegistrationSource};

impl<G: Gateway, R: RegistrationSource> Inner<G, R> {
    pub(super) async fn dispatch(&self, event: DispatchEvent) -> DispatchReport {
        let mut report = DispatchReport::default();
        let mut tally = Tally::default();
        self.run(&event, &mut report, &mut tally).await;
        self.failures.record_tally(&mut tally);
        report.failures = tally.into_counts();
        report
    }

    async fn run(&self, event: &DispatchEvent, report: &mut DispatchReport, tally: &mut Tally) {
        let now = (self.clock)();
        let state = match select::map_agent_state(event.agent_state.as_deref()) {
            // A dismissal is not an agent's result: it withdraws an earlier alert whatever the
            // agent does now (it may have resumed work), so it always goes, with a null state.
            Mapped::NotFinal if event.kind == orca_push_api::Kind::Dismiss => None,
            Mapped::NotFinal => {
                report.not_final = true;
                return;
            }
            Mapped::State(state) => state,
        };
        // The bare notification (what every gateway takes) is checked before anything else, so a
        // broken event is counted even when no phone would have taken it.
        if !select::is_valid(&select::notification(event, state, false, false)) {
            invalid(report, tally);
            return;
        }
        if event
            .expires_at
            .is_some_and(|at| at <= i64::try_from(now).unwrap_or(i64::MAX))
        {
            report.event_expired = true;
            return;
        }

        let mut recipients = self.recipients(event, state, now, report);
        if recipients.is_empty() {
            return;
        }
        let protocol = self.protocol.get(&*self.gateway, tally).await;
        report.delivery_protocol = Some(protocol);
        let with_kind = protocol >= DELIVERY_PROTOCOL_WITH_KIND;
        if event.kind == Kind::Dismiss && !with_kind {
            // An older gateway would send a dismissal as an alert, or refuse it.
            for r in recipients {
                report
                    .skipped
                    .insert(r.registration_id, Skip::DismissUnsupported);
            }
            return;
        }
        let audible = select::notification(event, state, with_kind, false);
        let silent = select::notification(event, state, with_kind, true);
        if !select::is_valid(&audible) {
            invalid(report, tally);
            return;
        }
        let needs_silent = with_kind && recipients.iter().any(select::is_silent);
        if needs_silent && !select::is_valid(&silent) {
            // Only the silent variant's `"sound": false` takes it over the cap: the phones that
            // want sound still get the event, and the silent ones are skipped, never sent a sound.
            recipients.retain(|r| {
                if select::is_silent(r) {
                    report
                        .skipped
                        .insert(r.registration_id.clone(), Skip::SilentTooLarge);
                    tally.add("silent_too_large");
                    false
                } else {
                    true
                }
            });
            if recipients.is_empty() {
                return;
            }
        }
        if event.kind != Kind::Dismiss {
            recipients = self.admit_burst(recipients, event.emitted_at.unwrap_or(now), report);
        }
        let batches = batches(recipients, with_kind);
        self.send_batches(&batches, &audible, &silent, event.expires_at, report, tally)
            .await;
    }

    /// The active registrations whose filter takes the event, each registration id once.
    fn recipients(
        &self,
        event: &DispatchEvent,
        state: Option<orca_push_api::AgentState>,
        now: u64,
        report: &mut DispatchReport,
    ) -> Vec<Registration> {
        let active = self.registrations.active(now);
        {
            let devices: HashSet<&str> = active.iter().map(|r| r.device_id.as_str()).collect();
            self.bursts().retain(&devices);
        }
        let mut seen = HashSet::new();
        let mut recipients = Vec::new();
        for registration in active {
            if !seen.insert(registration.registration_id.clone()) {
                continue;
            }
            match select::check(&registration, event, state, now) {
                Ok(()) => recipients.push(registration),
                Err(skip) => {
                    report.skipped.insert(registration.registration_id, skip);
                }
            }
        }
        recipients
    }

    /// Drops the phones that already had an alert in this burst window.
    fn admit_burst(
        &self,
        recipients: Vec<Registration>,
        emitted_at: u64,
        report: &mut DispatchReport,
    ) -> Vec<Registration> {
        let devices: Vec<&str> = recipients.iter().map(|r| r.device_id.as_str()).collect();
        let admitted = self.bursts().admit(&devices, emitted_at);
        let mut kept = Vec::with_capacity(recipients.len());
        for (registration, ok) in recipients.into_iter().zip(admitted) {
            if ok {
                kept.push(registration);
            } else {
                report
                    .skipped
                    .insert(registration.registration_id, Skip::Burst);
            }
        }
        kept
    }

    fn bursts(&self) -> std::sync::MutexGuard<'_, super::burst::BurstWindows> {
        self.bursts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn invalid(report: &mut DispatchReport, tally: &mut Tally) {
    report.invalid_event = true;
    tally.add("invalid_event");
}
