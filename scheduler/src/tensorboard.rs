//! TensorBoard event files of a run's metrics, so that `tensorboard --logdir` (or its
//! `EventAccumulator`) shows every metric the run records: one scalar tag per
//! `<stage>/<name>` (e.g. `update/effective_group_rate`, `learn/loss`,
//! `calibration/h0_validation_success`, `cost:base/wall_seconds`), at the metric's step.
//!
//! The format is TensorFlow's: TFRecord framing (length, masked CRC-32C of the length, the
//! record, masked CRC-32C of the record) around `Event` protocol buffers — a
//! `file_version` event first, then one `Event { wall_time, step, summary { value { tag,
//! simple_value } } }` per metric. The few protobuf fields are encoded here by hand;
//! everything is a pure function of the rows.

use schemas::MetricRow;

/// Where a run's event files go in the store.
pub fn events_prefix(run_id: &str) -> String {
    schemas::keys::tensorboard_prefix(run_id)
}

/// The name of an event file written at `ms` for part `part`: TensorBoard reads a
/// folder's event files in name order, so names start with the zero-padded time.
pub fn event_file_name(ms: i64, part: &str) -> String {
    format!("events.out.tfevents.{:013}.{part}", ms.max(0))
}

/// The scalar tag of a metric row.
pub fn tag(row: &MetricRow) -> String {
    format!("{}/{}", row.stage, row.name)
}

/// A whole event file for `rows`: the version record, then one scalar event per row.
pub fn encode(rows: &[MetricRow]) -> Vec<u8> {
    let first_ms = rows.iter().map(|r| r.recorded_at_ms).min().unwrap_or(0);
    let mut out = Vec::new();
    record(&mut out, &version_event(first_ms as f64 / 1000.0));
    for r in rows {
        record(&mut out, &scalar_event(r.recorded_at_ms as f64 / 1000.0, i64::from(r.step), &tag(r), r.value as f32));
    }
    out
}

/// `Event { wall_time: 1, file_version: 3 }`.
fn version_event(wall_time: f64) -> Vec<u8> {
    let mut e = Vec::new();
    e.push(0x09); // field 1, 64-bit
    e.extend_from_slice(&wall_time.to_le_bytes());
    bytes_field(&mut e, 3, b"brain.Event:2");
    e
}

/// `Event { wall_time: 1, step: 2, summary: 5 { value: 1 { tag: 1, simple_value: 2 } } }`.
fn scalar_event(wall_time: f64, step: i64, tag: &str, value: f32) -> Vec<u8> {
    let mut v = Vec::new();
    bytes_field(&mut v, 1, tag.as_bytes());
    v.push(0x15); // field 2, 32-bit
    v.extend_from_slice(&value.to_le_bytes());
    let mut summary = Vec::new();
    bytes_field(&mut summary, 1, &v);
    let mut e = Vec::new();
    e.push(0x09);
    e.extend_from_slice(&wall_time.to_le_bytes());
    e.push(0x10); // field 2, varint
    varint(&mut e, step as u64);
    bytes_field(&mut e, 5, &summary);
    e
}

fn bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    varint(out, u64::from(field << 3 | 2));
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// TFRecord framing of one record.
fn record(out: &mut Vec<u8>, data: &[u8]) {
    let len = (data.len() as u64).to_le_bytes();
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
}

/// TFRecord's masked CRC: rotate right by 15 and add a constant.
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), bitwise: event files are small.
fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for b in data {
        crc ^= u32::from(*b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 { (crc >> 1) ^ 0x82F6_3B78 } else { crc >> 1 };
        }
    }
    !crc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn records_are_framed_with_their_lengths() {
        let row = MetricRow {
            run_id: "r".into(),
            step: 3,
            stage: "learn".into(),
            name: "loss".into(),
            value: 0.5,
            policy_checkpoint: None,
            recorded_at_ms: 1_700_000_000_000,
        };
        let bytes = encode(&[row]);
        let mut at = 0;
        let mut records = 0;
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            assert_eq!(u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()), masked_crc(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + len];
            assert_eq!(u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap()), masked_crc(data));
            at += 16 + len;
            records += 1;
        }
        assert_eq!(records, 2, "the version record and one scalar");
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("brain.Event:2") && text.contains("learn/loss"));
        assert_eq!(event_file_name(1_700_000_000_000, "p1"), "events.out.tfevents.1700000000000.p1");
    }
}
