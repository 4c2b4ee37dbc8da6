//! The state the MTP head carries from one row to the next (docs/speculative.md, MTP
//! bookkeeping): for a main-model row, `model.norm(h)` of its final residual; for an MTP row,
//! the head's own output after `shared_head.norm`. Post-norm either way, never the raw
//! residual ([`Forward::pre_norm_hidden`](crate::model::Forward::pre_norm_hidden) is that).
//!
//! Here, apart from `model`, so that the decode loop can hold it without depending on the
//! model. Only the model builds one (its forwards and
//! [`Model::final_norm`](crate::model::Model::final_norm)), plus the saved-context loader
//! restoring rows the model built. The decode loop holds, slices, joins and passes them back
//! to the MTP forward; it cannot make one itself, so whatever reaches the head went through
//! the norm the model applies (a pre-norm residual passed by mistake does not type-check).

use std::ops::Range;

/// Rows of carried state, `[rows, width]` row-major (`width` is the model's hidden size).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Carried {
    values: Vec<f32>,
    width: usize,
}

impl Carried {
    /// Rows the model computed: `values` holds whole rows of `width`.
    pub(crate) fn new(values: Vec<f32>, width: usize) -> Self {
        debug_assert!(width > 0 && values.len().is_multiple_of(width));
        Carried { values, width }
    }

    /// Rows a saved context holds (`engine::saved`): the rows [`values`](Self::values) gave
    /// when it was written, read back after the file's fingerprint, shapes and checksum were
    /// checked against this model.
    pub(crate) fn from_saved(values: Vec<f32>, width: usize) -> Self {
        Carried { values, width }
    }

    /// Made-up rows for the decode loop's mock target (tests only).
    #[cfg(test)]
    pub(crate) fn for_test(values: Vec<f32>, width: usize) -> Self {
        Carried { values, width }
    }

    /// The values, `[rows, width]` row-major.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// Values per row (0 for an empty default).
    pub fn width(&self) -> usize {
        self.width
    }

    pub fn rows(&self) -> usize {
        self.values.len().checked_div(self.width).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// A copy of rows `rows`.
    pub fn slice(&self, rows: Range<usize>) -> Carried {
        Carried {
            values: self.values[rows.start * self.width..rows.end * self.width].to_vec(),
            width: self.width,
        }
    }

    /// Append `other`'s rows (of the same model, so of the same width).
    pub fn extend(&mut self, other: &Carried) {
        if self.values.is_empty() {
            self.width = other.width;
        }
        debug_assert!(other.is_empty() || other.width == self.width);
        self.values.extend_from_slice(&other.values);
    }

    /// Keep the first `rows` rows.
    pub fn truncate(&mut self, rows: usize) {
        self.values.truncate(rows * self.width);
    }

    /// Drop the first `rows` rows.
    pub fn drop_front(&mut self, rows: usize) {
        self.values.drain(..rows * self.width);
    }
}
