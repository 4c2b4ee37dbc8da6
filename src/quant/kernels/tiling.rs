//! The ISA-independent drivers of the x86 paths, as macros expanded inside each ISA module:
//! the names they use (`F32`, `Bf16`, `F16`, `Int8`, `Int4`, `group_magic`, `L`) resolve to
//! that module's own source types and lane width, so each expansion compiles with its
//! module's target features.

/// Run `$tile!(T, t0)` over all `s` activation rows: tiles of `TM`, then one smaller tile.
macro_rules! for_tiles {
    ($s:expr, $tm:expr, $tile:ident) => {{
        let (s, tm) = ($s, $tm);
        let mut t0 = 0;
        while s - t0 >= tm {
            match tm {
                8 => $tile!(8, t0),
                4 => $tile!(4, t0),
                3 => $tile!(3, t0),
                2 => $tile!(2, t0),
                _ => $tile!(1, t0),
            }
            t0 += tm;
        }
        match s - t0 {
            0 => {}
            1 => $tile!(1, t0),
            2 => $tile!(2, t0),
            3 => $tile!(3, t0),
            4 => $tile!(4, t0),
            5 => $tile!(5, t0),
            6 => $tile!(6, t0),
            _ => $tile!(7, t0),
        }
    }};
}

/// Expand `$body` with `$mk` bound to a closure `|w, o| -> Src` for row o of a matrix `w` in
/// format `$fmt` (one instantiation of `$body` per source type).
macro_rules! with_src {
    ($fmt:expr, |$mk:ident| $body:expr) => {{
        match $fmt {
            QuantFormat::F32 => {
                let $mk = |w: &QMatrix<'_>, o: usize| F32(w.row_data(o).as_ptr() as *const f32);
                $body
            }
            QuantFormat::Bf16 => {
                let $mk = |w: &QMatrix<'_>, o: usize| Bf16(w.row_data(o).as_ptr());
                $body
            }
            QuantFormat::F16 => {
                let $mk = |w: &QMatrix<'_>, o: usize| F16(w.row_data(o).as_ptr());
                $body
            }
            QuantFormat::Int8PerRow => {
                let $mk = |w: &QMatrix<'_>, o: usize| Int8 {
                    data: w.row_data(o).as_ptr(),
                    scale: w.row_scales(o)[0],
                };
                $body
            }
            f @ (QuantFormat::Int4PerRow | QuantFormat::Int4Grouped { .. }) => {
                let magic = group_magic(f, L);
                let $mk = move |w: &QMatrix<'_>, o: usize| Int4 {
                    data: w.row_data(o).as_ptr(),
                    scales: w.row_scales(o).as_ptr(),
                    magic,
                };
                $body
            }
        }
    }};
}

/// Row `$o` of `$w` dequantised into `$out` in natural order through this module's
/// [`with_src!`] sources: the whole vectors with its `store`, the partial last one with its
/// `store_last`.
macro_rules! dequantize_row_into {
    ($w:expr, $o:expr, $out:expr) => {{
        let (w, o, out): (&QMatrix<'_>, usize, &mut [f32]) = ($w, $o, $out);
        let n = w.cols();
        with_src!(w.format(), |mk| {
            let src = mk(w, o);
            let whole = n / L;
            for v in 0..whole {
                store(out.as_mut_ptr().add(v * L), src.one(v));
            }
            if !n.is_multiple_of(L) {
                store_last(src, whole, n, &mut out[whole * L..n]);
            }
        })
    }};
}
