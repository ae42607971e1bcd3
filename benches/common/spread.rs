//! Median and range over rounds: how every benchmark here summarizes repeated cells.

/// Median and range over rounds.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// `None` if no value is finite.
    pub fn of(mut values: Vec<f64>) -> Option<Self> {
        values.retain(|v| v.is_finite());
        values.sort_by(f64::total_cmp);
        let (min, max) = (*values.first()?, *values.last()?);
        let mid = values.len() / 2;
        let median = if values.len().is_multiple_of(2) { (values[mid - 1] + values[mid]) / 2.0 } else { values[mid] };
        Some(Self { median, min, max })
    }
}

/// A run that got answers its workloads did not expect measured something else: its report is written
/// (to see which cells), then the run fails, so that CI's smoke run catches a protocol answering wrongly.
pub fn refuse_unexpected(unexpected: u64) -> Result<(), String> {
    match unexpected {
        0 => Ok(()),
        n => Err(format!("{n} unexpected answers: see the report's cells")),
    }
}
