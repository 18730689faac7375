"""The `.nanoqwen` file, the INT4 quantizer and its weight layout, and the converters."""
